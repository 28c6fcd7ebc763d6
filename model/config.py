"""EncoderConfig: the shape of an encoder stack. No torch import: the service reads it too."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACTIVATIONS = ("relu", "gelu")
NORMS = ("layer", "rms")
FEED_FORWARDS = ("plain", "gated")
HEADS = ("none", "classify", "sparse")
HEAD_ACTIVATIONS = ("tanh", "relu", "gelu")
SPARSE_POOLINGS = ("max", "sum")  # SpladePooling's pooling_strategy
SPARSE_ACTIVATIONS = ("relu", "log1p_relu")  # SpladePooling's activation_function
# A sparse head's logits are vocabulary-wide for every position of a run (BERT's 30,522 a position): one run holds at
# most this many of them (256 MB of float32; about twice that at the run's peak, Engine.working_bytes), so a run's
# positions are capped by the vocabulary (run_tokens)
SPARSE_RUN_VALUES = 64 * 1024 * 1024
POOLINGS = (
    "none",
    "mean",
    "cls",
)  # a sentence embedding beside the encoded tokens: none, mean of real tokens, first


class ConfigError(ValueError):
    """An EncoderConfig field has a value the model cannot be built with."""


@dataclass(frozen=True)
class EncoderConfig:
    """Hyper-parameters of an encoder stack.

    Field names follow ``torch.nn.TransformerEncoderLayer`` so a config reads the same as the layer it mirrors;
    ``num_layers`` is the depth of the stack and ``norm`` picks LayerNorm (default) or RMSNorm. ``pooling`` adds a
    sentence embedding output (model.contract.POOLED) as sentence-transformers computes it: ``mean`` over each
    sequence's real tokens or its first (``cls``) token, L2-normalized with ``normalize_pooled``. ``packed``: the
    exported graph takes sequences of different lengths end to end, without padding (model/packing.py); the
    torch module is the same. ``relative_attention_buckets``: MPNet's relative position bias, a learned value per
    head and bucket of key - query distance added to every layer's attention scores (model/attention.py); 0: none.
    ``feed_forward``: ``plain`` = ``linear2(activation(linear1(x)))``; ``gated`` = a GLU as ModernBERT's:
    ``linear1`` projects to twice ``dim_feedforward``, its first half activated times its second (the gate), then
    ``linear2``. The state_dict's keys are the same either way; ``linear1``'s rows are ``feed_forward_rows``.
    ``head``: ``classify`` adds a sequence-classification head, the ``scores`` output (batch, ``num_labels``): the
    first token's vector through ``head.dense``, ``head_activation`` and ``head.out``, the logits transformers'
    ``*ForSequenceClassification`` computes (BERT's pooler and classifier, RoBERTa's and MPNet's classification head,
    DistilBERT's pre-classifier; a cross-encoder for reranking has one label). ``sparse`` adds a masked-LM head
    and SPLADE's pooling, the ``sparse_weights`` output (batch, ``vocab_size``): every token through ``head.dense``,
    ``head_activation``, ``head.norm`` and ``head.decoder`` (transformers' ``*ForMaskedLM`` logits), then over each
    sequence's real tokens ``log(1 + relu(logits))`` pooled by ``sparse_pooling`` (``max`` or ``sum``), with one
    more ``log1p`` for ``sparse_activation`` ``log1p_relu``: sentence-transformers' ``SpladePooling``.
    ModernBERT's block: ``bias`` false drops every bias of the block's products and norms (ONNX
    ``LayerNormalization`` without its B input); ``first_attention_norm`` false: the first layer's attention step
    adds its sublayer to an un-normalized input (pre-norm only: the embedding layer's norm came just before);
    ``rotary_theta``: rotary position embeddings (RoPE) of every head's queries and keys at this base (0: none),
    ``rotary_theta_local`` for local layers; ``attention_window``: local layers' queries attend to keys at most this
    many positions away (0: every layer global), and every layer whose index is a multiple of ``global_every`` is
    global (ModernBERT: a window of 64 each side, every third layer global from the first).
    """

    d_model: int = 768
    nhead: int = 12
    dim_feedforward: int = 3072
    dropout: float = 0.1
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    batch_first: bool = True
    num_layers: int = 1
    norm: str = "layer"
    pooling: str = "none"
    normalize_pooled: bool = False
    packed: bool = False
    relative_attention_buckets: int = 0
    feed_forward: str = "plain"
    head: str = "none"
    num_labels: int = 0
    head_activation: str = "tanh"
    vocab_size: int = 0
    sparse_pooling: str = "max"
    sparse_activation: str = "relu"
    bias: bool = True
    first_attention_norm: bool = True
    rotary_theta: float = 0.0
    rotary_theta_local: float = 0.0
    attention_window: int = 0
    global_every: int = 1

    def __post_init__(self) -> None:
        for name in ("d_model", "nhead", "dim_feedforward", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        buckets = self.relative_attention_buckets
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 0 or buckets % 4:
            raise ConfigError(
                f"relative_attention_buckets must be 0 (none) or a positive multiple of 4, got {buckets!r}"
            )
        if self.d_model % self.nhead:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by nhead ({self.nhead}) "
                f"so every head gets d_model / nhead features"
            )
        if (
            not isinstance(self.dropout, (int, float))
            or isinstance(self.dropout, bool)
            or not 0 <= self.dropout < 1
        ):
            raise ConfigError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.feed_forward not in FEED_FORWARDS:
            raise ConfigError(f"feed_forward must be one of {FEED_FORWARDS}, got {self.feed_forward!r}")
        if self.head not in HEADS:
            raise ConfigError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.head_activation not in HEAD_ACTIVATIONS:
            raise ConfigError(
                f"head_activation must be one of {HEAD_ACTIVATIONS}, got {self.head_activation!r}"
            )
        labels = self.num_labels
        if isinstance(labels, bool) or not isinstance(labels, int) or labels < 0:
            raise ConfigError(f"num_labels must be a non-negative integer, got {labels!r}")
        if (self.head == "classify") != (labels > 0):
            raise ConfigError(
                f"num_labels is {labels} with head {self.head!r}: a classify head needs at least one label, and "
                "no other head takes any"
            )
        vocab = self.vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
            raise ConfigError(f"vocab_size must be a non-negative integer, got {vocab!r}")
        if (self.head == "sparse") != (vocab > 0):
            raise ConfigError(
                f"vocab_size is {vocab} with head {self.head!r}: a sparse head needs the vocabulary's size, and "
                "no other head takes one"
            )
        if self.head == "sparse" and self.head_activation == "tanh":
            raise ConfigError(
                "head_activation tanh is a classification head's; a sparse (masked-LM) head's is gelu or relu"
            )
        if self.sparse_pooling not in SPARSE_POOLINGS:
            raise ConfigError(f"sparse_pooling must be one of {SPARSE_POOLINGS}, got {self.sparse_pooling!r}")
        if self.sparse_activation not in SPARSE_ACTIVATIONS:
            raise ConfigError(
                f"sparse_activation must be one of {SPARSE_ACTIVATIONS}, got {self.sparse_activation!r}"
            )
        if self.norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {self.norm!r}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"layer_norm_eps must be a number in (0, 1), got {eps!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        for name in ("norm_first", "batch_first", "normalize_pooled", "packed"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.normalize_pooled and self.pooling == "none":
            raise ConfigError("normalize_pooled needs a pooling ('mean' or 'cls'): there is no pooled output")
        for name in ("bias", "first_attention_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.first_attention_norm and not self.norm_first:
            raise ConfigError(
                "first_attention_norm false needs norm_first (pre-norm): a post-norm step always normalizes"
            )
        for name in ("rotary_theta", "rotary_theta_local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(
                    f"{name} must be a non-negative number (0: no rotary positions), got {value!r}"
                )
        if (self.rotary_theta > 0) != (self.rotary_theta_local > 0):
            raise ConfigError("rotary_theta and rotary_theta_local are both set (rotary positions) or both 0")
        if self.rotary_theta and self.head_dim % 2:
            raise ConfigError(
                f"rotary positions rotate pairs of features: the head width {self.head_dim} is odd"
            )
        for name, least in (("attention_window", 0), ("global_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer of at least {least}, got {value!r}")
        if self.packed and not self.batch_first:
            raise ConfigError("packed needs batch_first: a packed graph's tokens have no batch axis to order")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.nhead

    @property
    def task(self) -> str:
        """What a served model of this config answers: ``rerank`` (a classify head of one label: a cross-encoder's
        relevance), ``classify`` (several labels), ``sparse`` (SPLADE's vocabulary-wide weights) or ``embed``
        (vectors)."""
        if self.head == "classify":
            return "rerank" if self.num_labels == 1 else "classify"
        return "sparse" if self.head == "sparse" else "embed"

    @property
    def feed_forward_rows(self) -> int:
        """``linear1``'s output width: ``dim_feedforward``, twice that for a gated feed-forward (input and gate)."""
        return self.dim_feedforward * (2 if self.feed_forward == "gated" else 1)

    @property
    def num_norms(self) -> int:
        """The block's normalization steps: two Add & Norm steps per layer, plus a final norm for pre-norm (each a
        debug graph's step output)."""
        return 2 * self.num_layers + (1 if self.norm_first else 0)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends within ``attention_window`` only (a local layer) rather than globally."""
        return self.attention_window > 0 and layer % self.global_every != 0

    def rotary_base(self, layer: int) -> float:
        """``layer``'s rotary base (0: no rotary positions)."""
        return self.rotary_theta_local if self.is_local(layer) else self.rotary_theta

    @property
    def biased_layers(self) -> int:
        """Layers whose attention scores get an additive bias: every layer with MPNet's relative positions, the
        local layers with a window."""
        if self.relative_attention_buckets:
            return self.num_layers
        return sum(self.is_local(i) for i in range(self.num_layers))

    @property
    def norm_nodes(self) -> int:
        """Normalization nodes in the graph: the block's steps (``num_norms``) less the first layer's attention
        norm where it has none, and a head's own."""
        return self.num_norms - (0 if self.first_attention_norm else 1) + self.head_norms

    @property
    def head_norms(self) -> int:
        """A head's own LayerNormalization nodes, beyond the block's steps: the sparse (masked-LM) head's one."""
        return 1 if self.head == "sparse" else 0

    def run_tokens(self, limit: int) -> int:
        """Padded positions one run may hold, ``limit`` the server's (--max-batch-tokens): with a sparse head no
        more than SPARSE_RUN_VALUES of its logits (a single input longer than that still runs, alone)."""
        return min(limit, max(1, SPARSE_RUN_VALUES // self.vocab_size)) if self.head == "sparse" else limit

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"an encoder config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EncoderConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> EncoderConfig:
        return cls.from_json(Path(path).read_text())
