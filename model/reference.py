"""The encoder block in numpy float64: a second oracle that shares no code with torch.

``forward(config, weights, embeddings, mask)`` computes what ``model.encoder.Encoder`` computes, from the same
state_dict (``weights.safetensors``: ``layers.{i}.self_attn.in_proj_weight``, ``linear1``, ``norm1``, ... and the
final ``norm`` of a pre-norm stack), for every form the exporter produces: post- and pre-norm, LayerNorm and
RMSNorm, relu and exact (erf) GELU, plain and gated feed-forwards, key padding masks, MPNet's relative position bias,
ModernBERT's rotary positions, local attention windows, bias-free products and norms and first attention step
without a norm, stacks, batch-first or not. The attention form (mha, onnx,
decomposed) does not change the math, so there is one attention here. No torch: the serving side can run it.

``arithmetic`` (model/schemes.py) computes a lossy variant's own scheme instead: int8's quantized weight products,
fp16's half-precision results. The export gate and live parity use it for a lossy variant's allowance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from addnorm.model.attention import RELATIVE_MAX_DISTANCE, relative_buckets
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import ENCODED, POOLED, SCORES, SPARSE
from addnorm.model.schemes import Exact

EXACT = Exact()

try:  # the export extra has scipy: its erf is exact to float64 and about 100x faster than math.erf one by one
    from scipy.special import erf as _scipy_erf
except ImportError:  # the serving install (live parity) has no scipy
    _scipy_erf = None
_ERF = np.frompyfunc(math.erf, 1, 1)  # exact erf, elementwise (numpy has none)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise, in x's dtype."""
    return _scipy_erf(x) if _scipy_erf is not None else _ERF(x).astype(x.dtype)


def load_weights(source: str | Path | bytes, dtype: type = np.float64) -> dict[str, np.ndarray]:
    """An artifact's weights.safetensors (its path, or its bytes as read and checked: model.artifact.read_weights)
    as arrays of ``dtype`` by name."""
    from safetensors.numpy import load, load_file

    arrays = load(source) if isinstance(source, bytes) else load_file(str(source))
    return {k: v.astype(dtype) for k, v in arrays.items()}


def _norm(
    x: np.ndarray, weights: Mapping[str, np.ndarray], prefix: str, config: EncoderConfig, a: Exact
) -> np.ndarray:
    w = a.cast(weights[f"{prefix}.weight"])
    if config.norm == "rms":  # torch.nn.RMSNorm: x / sqrt(mean(x^2) + eps) * weight, no bias
        return a.cast(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.layer_norm_eps) * w)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased, as LayerNorm's
    normed = (x - mean) / np.sqrt(var + config.layer_norm_eps) * w
    return a.cast(normed + a.cast(_bias(weights, f"{prefix}.bias", w.shape[-1], w.dtype)))


def _bias(weights: Mapping[str, np.ndarray], name: str, width: int, dtype) -> np.ndarray:
    """A bias by name; zeros for a block without biases (``EncoderConfig.bias`` false: adding 0 is exact)."""
    found = weights.get(name)
    return np.zeros(width, dtype) if found is None else found


def _linear(x: np.ndarray, weights: Mapping[str, np.ndarray], name: str, a: Exact) -> np.ndarray:
    w = weights[f"{name}.weight"]
    return a.linear(x, w, _bias(weights, f"{name}.bias", w.shape[0], w.dtype))


def rotary_tables(base: float, head_dim: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) (S, D) of rotary positions (model.encoder.rotary_tables): the float32 angles (positions times
    the float64 frequencies rounded to float32, a product float32 rounds as torch and onnxruntime do), their cosine
    and sine in float64."""
    frequencies = (1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)
    angles = np.arange(seq, dtype=np.float32)[:, None] * frequencies[None, :]
    both = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return np.cos(both), np.sin(both)


def _rotate(t: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """(B, H, S, D) heads rotated by position (model.encoder.rotate)."""
    d = t.shape[-1] // 2
    turned = np.concatenate([-t[..., d:], t[..., :d]], axis=-1)
    return t * cos + turned * sin


def window_bias(seq: int, window: int, dtype) -> np.ndarray:
    """(1, 1, S, S) a local layer's scores' bias: 0 within ``window`` positions, else the dtype's most negative."""
    positions = np.arange(seq)
    far = np.abs(positions[None, :] - positions[:, None]) > window
    return np.where(far, np.finfo(dtype).min, 0.0).astype(dtype)[None, None]


def _activation(x: np.ndarray, name: str) -> np.ndarray:
    if name == "relu":
        return np.maximum(x, 0.0)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))  # torch's default (exact) GELU


def _attention(
    x: np.ndarray,
    weights: Mapping[str, np.ndarray],
    p: str,
    heads: int,
    mask: np.ndarray | None,
    a: Exact,
    bias: np.ndarray | None = None,
    rotary: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    b, s, e = x.shape
    d = e // heads
    w = weights[f"{p}.in_proj_weight"]
    qkv = a.linear(x, w, _bias(weights, f"{p}.in_proj_bias", w.shape[0], w.dtype))  # (B, S, 3E): q, k, v
    q, k, v = (qkv[..., i * e : (i + 1) * e].reshape(b, s, heads, d).transpose(0, 2, 1, 3) for i in range(3))
    if rotary is not None:
        q, k = (a.cast(_rotate(t, *rotary)) for t in (q, k))
    # In place on the (B, H, S, S) scores, the largest arrays here: the same arithmetic with no copy per step.
    scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, S, S)
    scores /= math.sqrt(d)
    if bias is not None:  # (1, H, S, S)
        scores += bias
    scores = a.cast(scores)
    if mask is not None:  # the most negative finite value of the dtype, as the torch block fills
        np.copyto(scores, np.finfo(scores.dtype).min, where=mask[:, None, None, :])
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = a.cast(probs)
    out = a.cast(probs @ v).transpose(0, 2, 1, 3).reshape(b, s, e)
    return _linear(out, weights, f"{p}.out_proj", a)


def position_bias(config: EncoderConfig, weights: Mapping[str, np.ndarray], seq: int) -> np.ndarray | None:
    """MPNet's relative position bias (1, H, S, S) (model.encoder.Encoder.position_bias); None without one."""
    if not config.relative_attention_buckets:
        return None
    table = np.asarray(relative_buckets(config.relative_attention_buckets))
    positions = np.arange(seq)
    distance = np.clip(positions[None, :] - positions[:, None], -RELATIVE_MAX_DISTANCE, RELATIVE_MAX_DISTANCE)
    values = weights["relative_attention_bias.weight"][table[distance + RELATIVE_MAX_DISTANCE]]  # (S, S, H)
    return values.transpose(2, 0, 1)[None]


def forward(
    config: EncoderConfig,
    weights: Mapping[str, np.ndarray],
    embeddings: np.ndarray,
    mask: np.ndarray | None = None,
    arithmetic: Exact = EXACT,
    steps: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The encoded tensor in the weights' dtype (float64 for the oracle; float32 weights give a float32 run,
    what any float32 implementation's own error looks like), in the input's layout ((B, S, E), or (S, B, E) when
    not batch-first); ``mask`` (B, S) bool, true where a position is padding. ``arithmetic``: a variant's scheme
    (model/schemes.py; give ``Half`` float32 weights). ``steps``: each Add & Norm result (and a pre-norm stack's
    final norm) is appended to it, batch first, as model.encoder.Encoder appends them."""
    a = arithmetic
    dtype = next(iter(weights.values())).dtype
    x = a.cast(np.asarray(embeddings, dtype=dtype))
    if not config.batch_first:
        x = x.transpose(1, 0, 2)
    mask = None if mask is None or not np.any(mask) else np.asarray(mask, dtype=bool)
    seq = x.shape[1]
    relative = position_bias(config, weights, seq)
    window = window_bias(seq, config.attention_window, x.dtype) if config.attention_window else None
    for i in range(config.num_layers):
        p = f"layers.{i}"
        bias = window if config.is_local(i) else relative
        base = config.rotary_base(i)
        rotary = rotary_tables(base, config.head_dim, seq) if base else None

        def attend(h: np.ndarray, p: str = p, bias=bias, rotary=rotary) -> np.ndarray:
            return _attention(h, weights, f"{p}.self_attn", config.nhead, mask, a, bias, rotary)

        def feed_forward(h: np.ndarray, p: str = p) -> np.ndarray:
            hidden = _linear(h, weights, f"{p}.linear1", a)
            if config.feed_forward == "gated":  # input and gate: the two halves of linear1's output
                f = config.dim_feedforward
                hidden = a.cast(a.cast(_activation(hidden[..., :f], config.activation)) * hidden[..., f:])
            else:
                hidden = a.cast(_activation(hidden, config.activation))
            return _linear(hidden, weights, f"{p}.linear2", a)

        for sublayer, norm in ((attend, f"{p}.norm1"), (feed_forward, f"{p}.norm2")):
            if i == 0 and norm.endswith("norm1") and not config.first_attention_norm:
                x = a.cast(x + sublayer(x))  # ModernBERT's first step: no norm before its attention
            elif config.norm_first:  # pre-norm: x + sublayer(Norm(x))
                x = a.cast(x + sublayer(_norm(x, weights, norm, config, a)))
            else:  # post-norm: Norm(x + sublayer(x))
                x = _norm(a.cast(x + sublayer(x)), weights, norm, config, a)
            if steps is not None:
                steps.append(x)
    if config.norm_first:
        x = _norm(x, weights, "norm", config, a)
        if steps is not None:
            steps.append(x)
    return x if config.batch_first else x.transpose(1, 0, 2)


def pool(config: EncoderConfig, tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The pooled output (model.encoder.pool) of batch-first tokens (B, S, E): mean over real tokens or the first
    token, L2-normalized when the config says so."""
    if config.pooling == "cls":
        pooled = tokens[:, 0]
    else:
        keep = np.ones(tokens.shape[:2], tokens.dtype) if mask is None else (~np.asarray(mask, bool))
        keep = keep.astype(tokens.dtype)[..., None]
        pooled = (tokens * keep).sum(axis=1) / np.maximum(keep.sum(axis=1), 1e-9)
    if config.normalize_pooled:
        pooled = pooled / np.maximum(np.sqrt((pooled * pooled).sum(axis=-1, keepdims=True)), 1e-12)
    return pooled


def outputs(
    config: EncoderConfig,
    weights: Mapping[str, np.ndarray],
    embeddings: np.ndarray,
    mask: np.ndarray | None = None,
    arithmetic: Exact = EXACT,
    steps: list[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Every output of the graph's contract by name (model.contract.output_names), as ``forward`` computes
    ``encoded``; the pooled output is computed from it in the same dtype."""
    encoded = forward(config, weights, embeddings, mask, arithmetic, steps)
    tokens = encoded if config.batch_first else encoded.transpose(1, 0, 2)
    out = {ENCODED: encoded}
    if config.pooling != "none":
        out[POOLED] = arithmetic.cast(pool(config, tokens, mask))
    if config.head == "classify":
        out[SCORES] = head(config, weights, tokens[:, 0], arithmetic)
    elif config.head == "sparse":
        out[SPARSE] = sparse_head(config, weights, tokens, mask, arithmetic)
    return out


def head(
    config: EncoderConfig, weights: Mapping[str, np.ndarray], first: np.ndarray, a: Exact = EXACT
) -> np.ndarray:
    """A classification head's scores (B, labels) of the first tokens (B, E) (model.encoder.ClassificationHead),
    in float under every scheme (``float_linear``)."""
    hidden = a.float_linear(first, weights["head.dense.weight"], weights["head.dense.bias"])
    hidden = (
        np.tanh(hidden) if config.head_activation == "tanh" else _activation(hidden, config.head_activation)
    )
    return a.float_linear(a.cast(hidden), weights["head.out.weight"], weights["head.out.bias"])


def sparse_head(
    config: EncoderConfig,
    weights: Mapping[str, np.ndarray],
    tokens: np.ndarray,
    mask: np.ndarray | None,
    a: Exact = EXACT,
) -> np.ndarray:
    """SPLADE's weights (B, vocab) of tokens (B, S, E) (model.encoder.SparseHead): the masked-LM logits of every
    token, ``log1p(relu(.))`` (twice for ``log1p_relu``) of the real ones, pooled by max or sum; in float. Under
    max the ``log1p`` follows the max, as the torch module's (it is increasing: the same answer), so the
    vocabulary-wide work per token is the product and a ``relu``."""
    hidden = a.float_linear(tokens, weights["head.dense.weight"], weights["head.dense.bias"])
    hidden = a.cast(_activation(hidden, "relu" if config.head_activation == "relu" else "gelu"))
    mean = hidden.mean(axis=-1, keepdims=True)
    var = ((hidden - mean) ** 2).mean(axis=-1, keepdims=True)
    hidden = a.cast(
        (hidden - mean) / np.sqrt(var + config.layer_norm_eps) * weights["head.norm.weight"]
        + weights["head.norm.bias"]
    )
    logits = a.float_linear(hidden, weights["head.decoder.weight"], weights["head.decoder.bias"])
    values = np.maximum(logits, 0.0, out=logits)  # (B, S, vocab), a fresh array: in place
    if mask is not None:
        values[np.asarray(mask, bool)] = 0.0  # the padding's tokens weigh nothing
    times = 2 if config.sparse_activation == "log1p_relu" else 1
    if config.sparse_pooling == "max":
        pooled = values.max(axis=1)
        for _ in range(times):
            pooled = np.log1p(pooled)
        return a.cast(pooled)
    for _ in range(times):
        values = np.log1p(values, out=values)
    return a.cast(values.sum(axis=1))
