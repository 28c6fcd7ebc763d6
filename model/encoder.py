"""The encoder block in PyTorch: Add & Norm, self-attention, feed-forward, block and stack.

Parameter names and shapes are those of ``torch.nn.TransformerEncoderLayer`` (``self_attn.in_proj_weight``,
``linear1``, ``norm1``, ...) and, for a stack, of ``torch.nn.TransformerEncoder`` (``layers.{i}.``, ``norm``),
so weights trained with PyTorch's own layers load unchanged.

Shapes: B batch, S sequence, E d_model, H heads, D head dim, F feed-forward width.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.model.attention import RELATIVE_MAX_DISTANCE, relative_buckets
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import ENCODED, POOLED, SCORES, SPARSE

Sublayer = Callable[[Tensor], Tensor]


class _AddNormMixin:
    """Add & Norm around a sublayer, on top of a normalization module (LayerNorm or RMSNorm).

    post-norm (the original Transformer): ``Norm(x + sublayer(x))``
    pre-norm (``norm_first``):            ``x + sublayer(Norm(x))``
    The module *is* the norm, so its parameters are ``weight``/``bias`` exactly like ``nn.LayerNorm``'s.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        norm_first: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        **norm: bool,
    ) -> None:
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype, **norm)  # type: ignore[call-arg]
        self.norm_first = norm_first

    def normalize(self, x: Tensor) -> Tensor:
        return super().forward(x)  # type: ignore[misc]

    def forward(self, x: Tensor, sublayer: Sublayer) -> Tensor:
        if self.norm_first:
            return x + sublayer(self.normalize(x))
        return self.normalize(x + sublayer(x))


class AddNorm(_AddNormMixin, nn.LayerNorm):
    """Residual add and LayerNorm (exported as ONNX ``LayerNormalization``).

    ``normalized_shape`` may cover the last k dims (the seeds normalize over two); the export then uses axis=-k.
    """


class AddRMSNorm(_AddNormMixin, nn.RMSNorm):
    """Residual add and RMSNorm (exported as ONNX ``RMSNormalization`` at opset 23)."""


class Add(nn.Module):
    """A pre-norm step without its norm, ``x + sublayer(x)``: ModernBERT's first attention step (its input is the
    embedding layer's normalized output). No parameters."""

    def forward(self, x: Tensor, sublayer: Sublayer) -> Tensor:
        return x + sublayer(x)


def make_norm(config: EncoderConfig, add: bool) -> nn.Module:
    """An Add & Norm step (``add=True``) or a plain norm of the configured kind."""
    bias = {"bias": config.bias} if config.norm == "layer" else {}
    if add:
        cls = AddNorm if config.norm == "layer" else AddRMSNorm
        return cls(config.d_model, eps=config.layer_norm_eps, norm_first=config.norm_first, **bias)
    if config.norm == "layer":
        return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, **bias)
    return nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)


def rotate(t: Tensor, cos: Tensor, sin: Tensor, nhead: int) -> Tensor:
    """Rotary position embedding of a (B, S, E) projection split into ``nhead`` heads: each head's features as
    two halves (x1, x2) -> x * cos + (-x2, x1) * sin, with ``cos`` and ``sin`` (S, D) by position (transformers'
    ``apply_rotary_pos_emb`` and ``rotate_half``)."""
    B, S, E = t.shape
    D = E // nhead
    t = t.reshape(B, S, nhead, D)
    turned = torch.cat([-t[..., D // 2 :], t[..., : D // 2]], dim=-1)
    return (t * cos[:, None, :] + turned * sin[:, None, :]).reshape(B, S, E)


def rotary_frequencies(base: float, head_dim: int) -> Tensor:
    """The float32 inverse frequencies ``base ** -(2i / D)`` of rotary positions, each the float64 value rounded
    once (the numpy oracle's are the same numbers: model/reference.py)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return (1.0 / base**exponents).to(torch.float32)


def rotary_tables(frequencies: Tensor, seq: Tensor | int) -> tuple[Tensor, Tensor]:
    """(cos, sin), (S, D): positions 0..S-1 times each frequency, in float32 as transformers computes the angles,
    each frequency's angle for both halves of a head; cos and sin in the frequencies' dtype (float64 in the gate's
    float64 run, as the oracle takes them)."""
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * frequencies.to(torch.float32)[None, :]
    both = torch.cat([angles, angles], dim=-1).to(frequencies.dtype)
    return both.cos(), both.sin()


def window_bias(seq: Tensor | int, window: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(1, 1, S, S): 0 where a key is at most ``window`` positions from the query, else the dtype's most negative
    value, as padding is filled (a local layer's scores: transformers' bidirectional sliding window,
    ``|q - k| <= window``)."""
    positions = torch.arange(seq)
    far = (positions[None, :] - positions[:, None]).abs() > window
    lowest = torch.finfo(dtype).min
    return torch.zeros(far.shape, dtype=dtype).masked_fill(far, lowest)[None, None]


def attend(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, nhead: int, bias: Tensor | None = None
) -> Tensor:
    """Scaled dot-product attention of (B, S, E) projections split into ``nhead`` heads -> (B, S, E).

    ``key_padding_mask`` (B, S) bool, true = padding; ``bias`` (1, H, S, S) added to the scaled scores (MPNet's
    relative positions: ``Encoder.position_bias``). The reference math: export traces it op by op, or swaps in one
    fused operator with the same results (export/attention.py).
    """
    B, S, E = q.shape
    D = E // nhead
    q, k, v = (t.reshape(B, S, nhead, D).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    # In place on the (B, H, S, S) scores: the same arithmetic (and graph) with two fewer copies of the largest
    # tensor, which the gate's float64 side otherwise spends a third of its attention time allocating.
    scores = (q @ k.transpose(-2, -1)).mul_(1.0 / math.sqrt(D))  # (B, H, S, S)
    if bias is not None:
        scores.add_(bias)
    if key_padding_mask is not None:
        # The most negative finite value rather than -inf: a row whose keys are all padding then gets
        # uniform weights instead of 0/0 = NaN, and any real key still outweighs padding completely.
        scores.masked_fill_(key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, S, E)


class Packing:
    """Sequences of different lengths laid end to end as packed tokens (1, T, E), and where each token sits in
    the padded (B, S) batch attention needs: the per-token work (projections, feed-forward, residual adds, norms)
    runs on real tokens only, attention on them padded (``pad``) and back (``unpad``).

    ``starts`` (B,) each sequence's first token, ``lengths`` (B,), ``seq`` the longest length, ``token_mask`` (T,)
    true where a token is a client's own padding. ``mask`` (B, S): the key padding mask of the padded batch (a
    client's padding, and every position beyond a sequence's length).
    """

    def __init__(self, starts: Tensor, lengths: Tensor, seq: Tensor | int, token_mask: Tensor) -> None:
        tokens = torch.arange(token_mask.shape[0])
        grid = torch.arange(seq)
        valid = grid[None, :] < lengths[:, None]  # (B, S)
        # (B, S): the token at each padded position; T (one past the last token) where there is none
        self.gather = torch.where(valid, starts[:, None] + grid[None, :], token_mask.shape[0])
        self.mask = torch.cat([token_mask, token_mask.new_ones(1)])[self.gather]
        # (T,) the sequence each token belongs to: how many sequences start at or before it, less one (starts[0] is
        # 0). Not a sum over starts[1:]: with one sequence that reduces an empty axis, which CUDA's ReduceSum refuses.
        row = (tokens[:, None] >= starts[None, :]).sum(1) - 1
        self.scatter = row * seq + tokens - starts[row]  # (T,) its position in the flattened (B * S)

    def pad(self, t: Tensor) -> Tensor:
        """(1, T, C) -> (B, S, C), zeros beyond each sequence's length."""
        flat = t[0]
        return torch.cat([flat, flat.new_zeros(1, flat.shape[1])])[self.gather]

    def unpad(self, p: Tensor) -> Tensor:
        """(B, S, C) -> (1, T, C)."""
        return p.reshape(-1, p.shape[-1])[self.scatter][None]


class SelfAttention(nn.Module):
    """Multi-head self-attention with a key padding mask, laid out like ``nn.MultiheadAttention``.

    ``self.attend`` computes attention from the projections; it is ``attend`` above unless export swaps in a
    fused kernel (export/attention.py). Dropout on the attention weights is not modelled (inference only).
    """

    def __init__(self, d_model: int, nhead: int, bias: bool = True) -> None:
        super().__init__()
        self.nhead = nhead
        self.head_dim = d_model // nhead
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))  # q, k, v stacked
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model)) if bias else None
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.attend = attend
        nn.init.xavier_uniform_(self.in_proj_weight)  # as nn.MultiheadAttention does
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        packing: Packing | None = None,
        bias: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x (B, S, E), or with ``packing`` the packed tokens (1, T, E): attention then runs on them padded.
        ``bias``: added to the attention scores (``attend``); ``rotary``: (cos, sin) (S, D) of rotary positions,
        applied to the queries and keys (padded: each sequence's positions from 0)."""
        E = x.shape[-1]
        w, b = self.in_proj_weight, self.in_proj_bias
        # Three projections on slices of the stacked weight: the slices fold into constants at export, and no
        # Split(num_outputs) is emitted (an opset-18 attribute that breaks conversion down to opset 17).
        q = F.linear(x, w[:E], None if b is None else b[:E])
        k = F.linear(x, w[E : 2 * E], None if b is None else b[E : 2 * E])
        v = F.linear(x, w[2 * E :], None if b is None else b[2 * E :])
        if packing is not None:
            q, k, v = (packing.pad(t) for t in (q, k, v))
        if rotary is not None:
            q, k = (rotate(t, *rotary, self.nhead) for t in (q, k))
        mask = key_padding_mask if packing is None else packing.mask
        out = self.attend(q, k, v, mask, self.nhead, bias)
        return self.out_proj(out if packing is None else packing.unpad(out))


class EncoderBlock(nn.Module):
    """One encoder layer: self-attention then feed-forward, each wrapped in Add & Norm.

    Its state_dict has exactly the keys of ``torch.nn.TransformerEncoderLayer`` (feed-forward weights sit at the
    top level as ``linear1``/``linear2``, as they do there); a gated feed-forward's ``linear1`` is twice as tall.
    """

    def __init__(self, config: EncoderConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config.d_model, config.nhead, config.bias)
        self.gated = config.feed_forward == "gated"
        self.linear1 = nn.Linear(config.d_model, config.feed_forward_rows, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.linear2 = nn.Linear(config.dim_feedforward, config.d_model, bias=config.bias)
        self.activation = F.relu if config.activation == "relu" else F.gelu  # exact (erf) GELU, as PyTorch's
        plain = index == 0 and not config.first_attention_norm  # ModernBERT's first attention step
        self.norm1 = Add() if plain else make_norm(config, add=True)
        self.norm2 = make_norm(config, add=True)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def feed_forward(self, x: Tensor) -> Tensor:
        """(B, S, E) -> (B, S, F) -> (B, S, E); gated: (B, S, 2F) -> its halves -> activation(input) * gate."""
        hidden = self.linear1(x)
        if not self.gated:
            return self.linear2(self.dropout(self.activation(hidden)))
        # Halves by slicing, not chunk(): no Split(num_outputs), an opset-18 attribute (as SelfAttention's q, k, v)
        width = hidden.shape[-1] // 2
        return self.linear2(self.dropout(self.activation(hidden[..., :width]) * hidden[..., width:]))

    def attention_step(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        packing: Packing | None = None,
        bias: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The first Add & Norm step: self-attention, residual add, norm."""
        return self.norm1(
            x, lambda h: self.dropout1(self.self_attn(h, key_padding_mask, packing, bias, rotary))
        )

    def feed_forward_step(self, x: Tensor) -> Tensor:
        """The second Add & Norm step: feed-forward, residual add, norm."""
        return self.norm2(x, lambda h: self.dropout2(self.feed_forward(h)))

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        steps: list[Tensor] | None = None,
        packing: Packing | None = None,
        bias: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x (B, S, E) -> (B, S, E), or packed tokens (1, T, E) with ``packing`` (every per-token step on them,
        attention padded). ``bias``: added to the attention scores; ``rotary``: (cos, sin) of rotary positions.
        Appends each Add & Norm result to ``steps`` when given."""
        x = self.attention_step(x, key_padding_mask, packing, bias, rotary)
        if steps is not None:
            steps.append(x)
        x = self.feed_forward_step(x)
        if steps is not None:
            steps.append(x)
        return x


class ClassificationHead(nn.Module):
    """A sequence-classification head on the first token: ``out(activation(dense(x)))``, (B, E) -> (B, labels).

    Its products are written as matrix products, not ``F.linear``: a lossy variant's scheme of the block's weight
    products (int8's) leaves them in float: two products on one token a sequence cost a small share of a run, and
    kept exact they add no error of their own to the scores."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.out = nn.Linear(config.d_model, config.num_labels)
        # BERT's pooler tanh, DistilBERT's relu, ELECTRA's exact GELU (transformers' "gelu")
        self.activation = {"tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu}[config.head_activation]

    def forward(self, first: Tensor) -> Tensor:
        hidden = self.activation(first @ self.dense.weight.T + self.dense.bias)
        return hidden @ self.out.weight.T + self.out.bias


class SparseHead(nn.Module):
    """A masked-LM head and SPLADE's pooling, (B, S, E) tokens and their padding mask -> (B, vocab) weights.

    ``decoder(norm(activation(dense(x))))`` are transformers' ``*ForMaskedLM`` logits of every token; then, as
    sentence-transformers' ``SpladePooling``, ``log(1 + relu(logits))`` of the real tokens pooled over the sequence
    (``max`` or ``sum``). Under ``max`` the ``log1p`` follows the max (it is increasing, so the answer is the same):
    the vocabulary-wide work per token is one product and a ``relu``. Its products are matrix products kept in float
    under every scheme, as ``ClassificationHead``'s."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        hidden = tokens @ self.dense.weight.T + self.dense.bias
        hidden = self.norm(F.gelu(hidden) if self.config.head_activation == "gelu" else F.relu(hidden))
        weights = F.relu(hidden @ self.decoder.weight.T + self.decoder.bias)  # (B, S, V)
        if mask is not None:
            weights = weights * (~mask).unsqueeze(-1).to(weights.dtype)
        times = 2 if self.config.sparse_activation == "log1p_relu" else 1
        if self.config.sparse_pooling == "max":
            pooled = weights.amax(1)
            for _ in range(times):
                pooled = log1p(pooled)
            return pooled
        for _ in range(times):
            weights = log1p(weights)
        return weights.sum(1)


def log1p(x: Tensor) -> Tensor:
    """log(1 + x) for x >= 0, accurate where x is tiny (exported as Log: opset 17 has no Log1p): where 1 + x rounds
    to 1 it is x, else log(1 + x) scaled by x over what 1 + x kept of it (Goldberg's correction)."""
    u = 1.0 + x
    return torch.where(u == 1.0, x, torch.log(u) * (x / (u - 1.0)))


class Encoder(nn.Module):
    """A stack of ``num_layers`` blocks, plus a final norm for pre-norm stacks (as ``nn.TransformerEncoder(norm=)``).

    ``forward(embeddings, mask)``: embeddings (B, S, E), or (S, B, E) when ``batch_first`` is false; mask (B, S)
    bool, true where a position is padding. Returns the encoded tensor in the input's layout.

    With ``relative_attention_buckets`` (MPNet) the stack holds ``relative_attention_bias`` (buckets, H), as
    transformers' MPNetEncoder does, and every layer's attention adds ``position_bias`` to its scores. With a
    ``head`` it holds it (``head.dense``, ``head.out``), and ``outputs`` gives its ``scores``.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(EncoderBlock(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, add=False) if config.norm_first else None
        self.relative_attention_bias: nn.Embedding | None = None
        if config.relative_attention_buckets:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_buckets, config.nhead)
            table = torch.tensor(relative_buckets(config.relative_attention_buckets), dtype=torch.long)
            self.register_buffer("bucket_of_distance", table, persistent=False)
        for name, base in (
            ("rotary_global", config.rotary_theta),
            ("rotary_local", config.rotary_theta_local),
        ):
            if base:  # not weights: a function of the config (not in the state_dict)
                self.register_buffer(name, rotary_frequencies(base, config.head_dim), persistent=False)
        heads = {"classify": ClassificationHead, "sparse": SparseHead}
        self.head = heads[config.head](config) if config.head in heads else None

    def position_bias(self, seq: Tensor | int) -> Tensor | None:
        """(1, H, S, S): each head's learned bias for the bucket of every key - query distance; None without one.
        The distances of a padded batch's real tokens are those of each sequence alone (padding comes last)."""
        if self.relative_attention_bias is None:
            return None
        positions = torch.arange(seq)
        distance = (positions[None, :] - positions[:, None]).clamp(
            -RELATIVE_MAX_DISTANCE, RELATIVE_MAX_DISTANCE
        )
        bucket = self.bucket_of_distance[distance + RELATIVE_MAX_DISTANCE]  # (S, S)
        return self.relative_attention_bias(bucket).permute(2, 0, 1)[None]

    def positional(
        self, seq: Tensor | int, dtype: torch.dtype = torch.float32
    ) -> list[tuple[Tensor | None, tuple[Tensor, Tensor] | None]]:
        """Each layer's (score bias, rotary tables) for sequences of ``seq`` positions: MPNet's relative position
        bias or a local layer's window (``window_bias``, in the scores' ``dtype``), and the (cos, sin) of its rotary
        base; each computed once."""
        relative = self.position_bias(seq)
        window = (
            window_bias(seq, self.config.attention_window, dtype) if self.config.attention_window else None
        )
        tables = {
            name: rotary_tables(getattr(self, f"rotary_{name}"), seq)
            for name in ("global", "local")
            if hasattr(self, f"rotary_{name}")
        }
        out = []
        for i in range(self.config.num_layers):
            local = self.config.is_local(i)
            out.append((window if local else relative, tables.get("local" if local else "global")))
        return out

    def forward(
        self, embeddings: Tensor, mask: Tensor | None = None, steps: list[Tensor] | None = None
    ) -> Tensor:
        x = embeddings if self.config.batch_first else embeddings.transpose(0, 1)  # (B, S, E)
        for layer, (bias, rotary) in zip(self.layers, self.positional(x.shape[1], x.dtype), strict=True):
            x = layer(x, mask, steps, bias=bias, rotary=rotary)
        if self.norm is not None:
            x = self.norm(x)
            if steps is not None:
                steps.append(x)
        return x if self.config.batch_first else x.transpose(0, 1)

    def outputs(
        self, embeddings: Tensor, mask: Tensor | None = None, steps: list[Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Every output of the graph's contract by name (model.contract.OUTPUT_NAMES), as export, the parity gate
        and the golden data read them; ``forward`` returns ``encoded`` alone, as ``nn.TransformerEncoder`` does."""
        encoded = self(embeddings, mask, steps)
        return self._with_heads(
            encoded, encoded if self.config.batch_first else encoded.transpose(0, 1), mask
        )

    def _with_heads(self, encoded: Tensor, tokens: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """The outputs computed from the encoded ``tokens`` (B, S, E): the pooled embedding, a head's scores."""
        out = {ENCODED: encoded}
        if self.config.pooling != "none":
            out[POOLED] = pool(tokens, mask, self.config.pooling, self.config.normalize_pooled)
        if self.config.head == "classify":
            out[SCORES] = self.head(tokens[:, 0])
        elif self.config.head == "sparse":
            out[SPARSE] = self.head(tokens, mask)
        return out

    def packed_outputs(
        self, tokens: Tensor, packing: Packing, steps: list[Tensor] | None = None
    ) -> dict[str, Tensor]:
        """``outputs`` of packed tokens (1, T, E) (batch-first stacks only): every per-token step on the tokens,
        attention padded; the outputs padded to (B, S, E), zeros beyond each sequence's length, as are ``steps``."""
        packed_steps: list[Tensor] | None = None if steps is None else []
        x = tokens
        positional = self.positional(packing.gather.shape[1], tokens.dtype)
        for layer, (bias, rotary) in zip(self.layers, positional, strict=True):
            x = layer(x, None, packed_steps, packing, bias, rotary)
        if self.norm is not None:
            x = self.norm(x)
            if packed_steps is not None:
                packed_steps.append(x)
        if steps is not None:
            steps.extend(packing.pad(t) for t in packed_steps or [])
        encoded = packing.pad(x)
        return self._with_heads(encoded, encoded, packing.mask)


def pool(tokens: Tensor, mask: Tensor | None, how: str, normalize: bool) -> Tensor:
    """(B, S, E) -> (B, E), sentence-transformers' arithmetic (its Pooling and Normalize modules): ``mean`` sums
    the real tokens (``mask`` true = padding) and divides by their count (at least 1e-9), ``cls`` takes the first
    position; ``normalize`` divides by the L2 norm (at least 1e-12)."""
    if how == "cls":
        pooled = tokens[:, 0]
    else:
        keep = torch.ones_like(tokens[..., :1]) if mask is None else (~mask).unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
    if not normalize:
        return pooled
    # F.normalize's arithmetic, spelled with a sum: its ReduceL2 has no opset-17 form the exporter converts to
    return pooled / (pooled * pooled).sum(-1, keepdim=True).sqrt().clamp(min=1e-12)


def build_encoder(config: EncoderConfig, seed: int | None = 0) -> Encoder:
    """A deterministic, seeded encoder in eval mode (the default weights of an export)."""
    if seed is None:
        return Encoder(config).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Encoder(config).eval()
