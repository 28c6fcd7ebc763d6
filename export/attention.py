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

Every form computes ``model.encoder.attend``'s results: torch traces a stand-in whose eager value is exactly that
function, and only its ONNX spelling differs. The parity gate checks each form against the float64 oracle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import onnxscript
import torch
import torch.nn.functional as F
from onnx import TensorProto
from onnx.defs import OpSchema
from onnxscript import opset17 as op
from torch import Tensor

from addnorm.model.attention import FORMS
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import Encoder, attend

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
    """The attention nodes a graph of ``form`` must hold (If branches counted), and no Softmax unless decomposed."""
    layers, biased = config.num_layers, config.biased_layers
    if form == "mha":  # a layer with a bias on its scores has no flash kernel to keep: one, masked
        return {"If": layers - biased, "MultiHeadAttention": 2 * (layers - biased) + biased, "Softmax": 0}
    if form == "onnx":
        return {"Attention": layers, "Softmax": 0}
    return {"Softmax": layers}


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


KERNELS: dict[str, Callable[..., Tensor]] = {"mha": _attend_mha, "onnx": _attend_onnx, "decomposed": attend}
TRANSLATIONS = {
    torch.ops.addnorm.mha.default: _mha_onnx,
    torch.ops.addnorm.mha_unmasked.default: _mha_unmasked_onnx,
    torch.ops.addnorm.mha_biased.default: _mha_biased_onnx,
}


@contextlib.contextmanager
def spelled(encoder: Encoder, form: str) -> Iterator[None]:
    """Within the block, ``encoder``'s attention traces as ``form``; its eager results do not change."""
    modules = [layer.self_attn for layer in encoder.layers]
    saved = [m.attend for m in modules]
    for m in modules:
        m.attend = KERNELS[form]
    try:
        yield
    finally:
        for m, kernel in zip(modules, saved, strict=True):
            m.attend = kernel
