"""How attention is spelled in the exported graph: ``addnorm-export --attention auto|mha|onnx|decomposed``.

- ``mha``: onnxruntime's ``com.microsoft.MultiHeadAttention``, any opset, CPU and CUDA. With no padding in a
  batch it runs onnxruntime's flash-attention kernel, which never holds a seq x seq tensor; a key padding mask
  turns that kernel off (one score tensor then). So each layer holds an ``If`` on "is any position padding?"
  with one MultiHeadAttention in each branch, the mask given only where there is padding. With a bias on the scores
  (its ``attention_bias`` input: MPNet's relative positions, a local layer's window) there is no flash kernel to
  keep: one MultiHeadAttention, masked.
- ``onnx``: ONNX's own ``Attention`` operator (opset >= 23), for runtimes without onnxruntime's contrib ops.
  onnxruntime's CPU kernel wants the mask as ``[B, 1, S, S]`` and answers zeros for a query whose keys are all
  padding, so the graph broadcasts the mask and puts the reference's answer (uniform weights) back for those rows.
- ``decomposed``: MatMul, Where, Softmax, MatMul, op by op: runs anywhere, holds several score tensors.
- ``auto``: ``mha`` (the fastest that passes the gate on CPU and CUDA: docs/benchmarks.md, "The cost curve").

``mha`` is onnxruntime's spelling of the block, so its feed-forward's exact GELU is onnxruntime's too: one
``com.microsoft.Gelu``, which onnxruntime's session fuses with the bias add before it into one ``BiasGelu``, where the
exporter's standard spelling (Div, Erf, Add, Mul, Mul) is five operators over the feed-forward's widest tensor that
onnxruntime 1.32 does not fuse (docs/benchmarks.md, "GELU as one operator"). The other forms keep the standard one.

Every form computes ``model.encoder.attend``'s results: torch traces a stand-in whose eager value is exactly that
function, and only its ONNX spelling differs. The parity gate checks each form against the float64 oracle.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import numpy as np
import onnx
import onnxscript
import torch
import torch.nn.functional as F
from onnx import TensorProto
from onnx.defs import OpSchema
from onnxscript import opset17 as op
from torch import Tensor

from addnorm.model import attention as held
from addnorm.model.attention import FORMS
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import Encoder, attend, window_bias

CHOICES = ("auto", *FORMS)
AUTO = "mha"
ONNX_ATTENTION_MIN_OPSET = 23
_LOWEST = float(torch.finfo(torch.float32).min)  # the reference's fill for padded keys


class AttentionError(ValueError):
    """An attention form that cannot be exported as asked."""


def resolve(choice: str, opset: int) -> str:
    """The form ``choice`` stands for at ``opset`` (``auto`` -> the measured default)."""
    form = AUTO if choice == "auto" else choice
    if form not in FORMS:
        raise AttentionError(f"unknown attention {choice!r}; choose one of {', '.join(CHOICES)}")
    if form == "onnx" and opset < ONNX_ATTENTION_MIN_OPSET:
        raise AttentionError(
            f"--attention onnx exports ONNX's Attention operator, which needs opset {ONNX_ATTENTION_MIN_OPSET}; "
            f"use --opset {ONNX_ATTENTION_MIN_OPSET}, or --attention mha (any opset)"
        )
    return form


def expected_ops(form: str, config: EncoderConfig) -> dict[str, int]:
    """The attention nodes a graph of ``form`` must hold (If branches counted), and no Softmax unless decomposed; in
    a form that spells the exact GELU as onnxruntime's (``GELUS``), a Gelu per layer of a GELU feed-forward (the
    other forms' own spelling is the exporter's; the fused variant's optimizer may make it a Gelu too)."""
    layers, biased = config.num_layers, config.biased_layers
    local = sum(config.is_local(i) for i in range(layers))
    gelu = {"Gelu": layers if config.activation == "gelu" else 0} if form in GELUS else {}
    if form == "mha":  # a layer with a bias on its scores has no flash kernel to keep: one, masked; a local
        # layer's If: banded (one Softmax) or that one
        return {
            "If": layers - biased + local,
            "MultiHeadAttention": 2 * (layers - biased) + biased,
            "Softmax": local,
            **gelu,
        }
    if form == "onnx":
        return {"Attention": layers, "Softmax": 0, **gelu}
    return {"Softmax": layers, **gelu}


# --- mha: a torch custom op whose eager value is the reference, translated to com.microsoft.MultiHeadAttention


@torch.library.custom_op("addnorm::mha", mutates_args=())
def _mha(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, nhead: int) -> Tensor:
    return attend(q, k, v, key_padding_mask, nhead)


@torch.library.custom_op("addnorm::mha_unmasked", mutates_args=())
def _mha_unmasked(q: Tensor, k: Tensor, v: Tensor, nhead: int) -> Tensor:
    return attend(q, k, v, None, nhead)


@torch.library.custom_op("addnorm::mha_biased", mutates_args=())
def _mha_biased(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, bias: Tensor, nhead: int
) -> Tensor:
    return attend(q, k, v, key_padding_mask, nhead, bias)


@_mha.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, nhead: int) -> Tensor:
    return torch.empty_like(q)


@_mha_biased.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, bias: Tensor, nhead: int) -> Tensor:
    return torch.empty_like(q)


@_mha_unmasked.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, nhead: int) -> Tensor:
    return torch.empty_like(q)


def _mha_schema() -> OpSchema:
    """The part of onnxruntime's MultiHeadAttention (com.microsoft, since 1) that these graphs use."""
    fp, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    return OpSchema(
        "MultiHeadAttention",
        "com.microsoft",
        1,
        inputs=[
            fp("query", "T"),
            fp("key", "T", param_option=optional),
            fp("value", "T", param_option=optional),
            fp("bias", "T", param_option=optional),
            fp("key_padding_mask", "M", param_option=optional),
            fp("attention_bias", "T", param_option=optional),  # (1 or B, 1 or H, S, S), added to the scores
        ],
        outputs=[fp("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "", required=True),
            OpSchema.Attribute("mask_filter_value", OpSchema.AttrType.FLOAT, "", required=False),
        ],
    )


_MHA = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MultiHeadAttention", _mha_schema())


def _mha_onnx(q, k, v, key_padding_mask, nhead: int):
    # onnxruntime's mask is int32 with 1 = attend; masked scores become mask_filter_value, as in the reference.
    keep = op.Cast(op.Not(key_padding_mask), to=TensorProto.INT32)
    return _MHA(q, k, v, None, keep, num_heads=nhead, mask_filter_value=_LOWEST)


def _mha_unmasked_onnx(q, k, v, nhead: int):
    return _MHA(q, k, v, num_heads=nhead)


def _mha_biased_onnx(q, k, v, key_padding_mask, bias, nhead: int):
    keep = op.Cast(op.Not(key_padding_mask), to=TensorProto.INT32)
    return _MHA(q, k, v, None, keep, bias, num_heads=nhead, mask_filter_value=_LOWEST)


def _attend_mha(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, nhead: int, bias: Tensor | None = None
) -> Tensor:
    if bias is not None:
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(q.shape[:2], dtype=torch.bool)
        return _mha_biased(q, k, v, key_padding_mask, bias, nhead)
    if key_padding_mask is None:
        return _mha_unmasked(q, k, v, nhead)
    if not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        # Run eagerly (the gate's torch side): torch.cond would compile both branches with dynamo on each new
        # shape and dtype, 2 s the first time and 0.1-0.2 s each after.
        if key_padding_mask.any():
            return _mha(q, k, v, key_padding_mask, nhead)
        return _mha_unmasked(q, k, v, nhead)
    # The sum, not any(): any() exports a ReduceMax attribute that opset 17 lacks.
    return torch.cond(
        key_padding_mask.to(torch.int32).sum() > 0,
        lambda q, k, v, m: _mha(q, k, v, m, nhead),
        lambda q, k, v, m: _mha_unmasked(q, k, v, nhead),
        (q, k, v, key_padding_mask),
    )


# --- onnx: scaled_dot_product_attention, which the exporter writes as one Attention node at opset >= 23


def _attend_onnx(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, nhead: int, bias: Tensor | None = None
) -> Tensor:
    B, S, E = q.shape
    q, k, v = (t.reshape(B, S, nhead, E // nhead).transpose(1, 2) for t in (q, k, v))
    if key_padding_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        if bias is None:
            added = torch.zeros(key_padding_mask.shape, dtype=q.dtype).masked_fill(key_padding_mask, _LOWEST)
            added = added[:, None, None, :].expand(B, 1, S, S)
        else:  # MPNet's relative positions, then the padding: the reference's order
            added = bias.expand(B, nhead, S, S).masked_fill(key_padding_mask[:, None, None, :], _LOWEST)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=added)
        if bias is None:
            all_padding = key_padding_mask.all(dim=-1)[:, None, None, None]
        else:  # a query whose keys are all masked, by its window and padding: (B, H, S, 1)
            all_padding = (added <= _LOWEST).all(dim=-1, keepdim=True)
        # The reference's uniform weights; a sum, not mean(): ReduceMean is what the graph checks take for a
        # LayerNorm spelled out.
        out = torch.where(all_padding, v.sum(dim=-2, keepdim=True) / S, out)
    return out.transpose(1, 2).reshape(B, S, E)


# --- a local layer's window in mha graphs: banded past BANDED_FROM positions, one masked MultiHeadAttention below
#
# A local layer's query sees only the keys within ``window`` positions of it. Spelled as a bias on full attention it
# holds heads x seq x seq scores (3.2 GB a layer at 8,192 tokens, 12 heads) and computes them all; the banded form
# cuts the sequence into blocks of ``window`` queries, each scoring the keys of its own block and its two
# neighbours (3 x window keys, which hold every key within the window): heads x seq x 3 window scores.
# Up to BANDED_FROM (model/attention.py) positions the full form is as fast or faster (docs/benchmarks.md).


@torch.library.custom_op("addnorm::banded", mutates_args=())
def _banded(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, nhead: int, head_dim: int, window: int
) -> Tensor:
    return attend(q, k, v, key_padding_mask, nhead, window_bias(q.shape[1], window, q.dtype))


@_banded.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, nhead: int, head_dim: int, window: int
) -> Tensor:
    return torch.empty_like(q)


def _ints(*values: int):
    return op.Constant(value_ints=list(values))


def _padded(t, axis: int, before, after):
    """``t`` with ``before`` and ``after`` (1,) zeros along ``axis`` (not Pad: onnx's converter has no Pad
    from opset 18 down to 17)."""

    def zeros(count):
        shape = op.Concat(op.Shape(t, start=0, end=axis), count, op.Shape(t, start=axis + 1), axis=0)
        return op.Expand(op.CastLike(op.Constant(value_float=0.0), t), shape)

    return op.Concat(*([zeros(before)] if before is not None else []), t, zeros(after), axis=axis)


def _banded_onnx(q, k, v, key_padding_mask, nhead: int, head_dim: int, window: int):
    """``attend`` with a window of ``window`` positions, in blocks of ``window`` queries: (B, S, E) -> (B, S, E)."""
    block, zero = window, _ints(0)
    seq = op.Shape(q, start=1, end=2)
    blocks = op.Div(op.Add(seq, _ints(block - 1)), _ints(block))  # n: the queries padded to whole blocks
    tail = op.Sub(op.Mul(blocks, _ints(block)), seq)
    ahead = op.Add(tail, _ints(block))

    def heads(t):  # (B, S, E) -> (B, H, S, D)
        return op.Transpose(op.Reshape(t, _ints(0, 0, nhead, head_dim)), perm=[0, 2, 1, 3])

    def neighbours(t, axis: int):
        """(..., n + 2, ...) blocks -> each block beside the ones before and after it."""
        return op.Concat(
            op.Slice(t, _ints(0), _ints(-2), _ints(axis)),
            op.Slice(t, _ints(1), _ints(-1), _ints(axis)),
            op.Slice(t, _ints(2), _ints(2**62), _ints(axis)),
            axis=axis + 1,
        )

    # queries (B, H, n, c, D); keys and values one block of padding before, the tail and one block after:
    # (B, H, n, 3c, D), the keys of block i are positions (i - 1)c .. (i + 2)c - 1
    queries = op.Reshape(_padded(heads(q), 2, None, tail), _ints(0, 0, -1, block, head_dim))
    keys, values = (
        neighbours(op.Reshape(_padded(heads(t), 2, _ints(block), ahead), _ints(0, 0, -1, block, head_dim)), 2)
        for t in (k, v)
    )
    # which keys each query takes: real (not padding, not outside the sequence) and within the window
    real = _padded(op.Cast(op.Not(key_padding_mask), to=TensorProto.FLOAT), 1, _ints(block), ahead)
    real = op.Unsqueeze(neighbours(op.Reshape(real, _ints(0, -1, block)), 1), _ints(1, 3))  # (B, 1, n, 1, 3c)
    offsets = np.arange(3 * block)[None, :] - block - np.arange(block)[:, None]  # key - query, (c, 3c)
    near = (np.abs(offsets) <= window).astype(np.float32)
    taken = op.Mul(real, op.Constant(value=onnx.numpy_helper.from_array(near)))  # (B, 1, n, c, 3c)
    scores = op.Mul(
        op.MatMul(queries, op.Transpose(keys, perm=[0, 1, 2, 4, 3])),
        op.CastLike(op.Constant(value_float=1.0 / math.sqrt(head_dim)), q),
    )
    scores = op.Where(
        op.Equal(taken, op.Constant(value_float=0.0)),
        op.CastLike(op.Constant(value_float=-math.inf), q),
        scores,
    )
    out = op.MatMul(op.Softmax(scores, axis=-1), values)  # (B, H, n, c, D); NaN where a query takes no key
    # a query that takes no key (padding far from any real token): the reference's uniform weights over all keys
    anything = op.Greater(op.ReduceSum(taken, _ints(-1), keepdims=1), op.Constant(value_float=0.0))
    mean = op.Div(op.ReduceSum(heads(v), _ints(2), keepdims=1), op.CastLike(seq, q))  # (B, H, 1, D)
    out = op.Where(anything, out, op.Unsqueeze(mean, _ints(2)))
    out = op.Slice(op.Reshape(out, _ints(0, 0, -1, head_dim)), zero, seq, _ints(2))  # (B, H, S, D)
    return op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), _ints(0, 0, nhead * head_dim))


def _attend_local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    nhead: int,
    bias: Tensor | None = None,
    *,
    window: int,
) -> Tensor:
    """A local layer's attention (``bias`` is its window, ``window_bias``): the reference eagerly; traced, an ``If``
    on the sequence's length between the banded form and one masked MultiHeadAttention."""
    if not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        return attend(q, k, v, key_padding_mask, nhead, bias)
    if key_padding_mask is None:
        key_padding_mask = torch.zeros(q.shape[:2], dtype=torch.bool)
    head_dim = q.shape[-1] // nhead
    return torch.cond(
        torch.ones_like(key_padding_mask[0], dtype=torch.int32).sum() > held.BANDED_FROM,
        lambda q, k, v, m: _banded(q, k, v, m, nhead, head_dim, window),
        lambda q, k, v, m: _mha_biased(q, k, v, m, window_bias(q.shape[1], window, q.dtype), nhead),
        (q, k, v, key_padding_mask),
    )


# --- mha's feed-forward: the exact GELU as onnxruntime's com.microsoft.Gelu (its bias add fused in by the session)


@torch.library.custom_op("addnorm::gelu", mutates_args=())
def _gelu(x: Tensor) -> Tensor:
    return F.gelu(x)


@_gelu.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


_GELU = onnxscript.values.Op(
    onnxscript.values.Opset("com.microsoft", 1),
    "Gelu",
    OpSchema(
        "Gelu",
        "com.microsoft",
        1,
        inputs=[OpSchema.FormalParameter("X", "T")],
        outputs=[OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
    ),
)


def _gelu_onnx(x):
    return _GELU(x)


KERNELS: dict[str, Callable[..., Tensor]] = {"mha": _attend_mha, "onnx": _attend_onnx, "decomposed": attend}
# each form's feed-forward activation in place of the exact GELU (F.gelu); a form not here keeps F.gelu
GELUS: dict[str, Callable[[Tensor], Tensor]] = {"mha": _gelu}
TRANSLATIONS = {
    torch.ops.addnorm.mha.default: _mha_onnx,
    torch.ops.addnorm.mha_unmasked.default: _mha_unmasked_onnx,
    torch.ops.addnorm.mha_biased.default: _mha_biased_onnx,
    torch.ops.addnorm.banded.default: _banded_onnx,
    torch.ops.addnorm.gelu.default: _gelu_onnx,
}


@contextlib.contextmanager
def spelled(encoder: Encoder, form: str) -> Iterator[None]:
    """Within the block, ``encoder``'s attention (and its feed-forward's exact GELU: ``GELUS``) traces as ``form``; its
    eager results do not change."""
    modules = [layer.self_attn for layer in encoder.layers]
    saved = [(m.attend, layer.activation) for m, layer in zip(modules, encoder.layers, strict=True)]
    window = encoder.config.attention_window
    for i, (m, layer) in enumerate(zip(modules, encoder.layers, strict=True)):
        local = form == "mha" and encoder.config.is_local(i)
        m.attend = functools.partial(_attend_local, window=window) if local else KERNELS[form]
        if layer.activation is F.gelu:
            layer.activation = GELUS.get(form, F.gelu)
    try:
        yield
    finally:
        for m, layer, (kernel, activation) in zip(modules, encoder.layers, saved, strict=True):
            m.attend, layer.activation = kernel, activation
