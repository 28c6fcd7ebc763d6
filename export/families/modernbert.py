"""ModernBERT (gte-modernbert, modernbert-embed and their fine-tunes): pre-norm without biases, a gated GELU
feed-forward, rotary positions (a base for global layers and one for local ones), local layers attending within a
window of ``local_attention`` / 2 positions each side, every ``global_attn_every_n_layers``-th layer global from the
first; no first attention norm (the embedding layer's norm precedes it), a final norm, and an embedding layer of the
token's embedding and a norm only (no position or token type tables)."""

from __future__ import annotations

from addnorm.export.families import Family, activation, present
from addnorm.model.config import ConfigError

LAYER_KEYS = {  # encoder block key -> ModernBertEncoderLayer key (no biases anywhere)
    "self_attn.out_proj.weight": "attn.Wo.weight",
    "norm1.weight": "attn_norm.weight",  # not in layer 0 (an identity there)
    "linear1.weight": "mlp.Wi.weight",  # input and gate stacked, as the gated feed-forward takes them
    "linear2.weight": "mlp.Wo.weight",
    "norm2.weight": "mlp_norm.weight",
}
QKV = ("attn.Wqkv",)  # q, k and v already stacked, in that order
EMBEDDINGS = {"word_embeddings": "tok_embeddings", "LayerNorm": "norm"}
THETA = {
    "full_attention": ("global_rope_theta", 160_000.0),
    "sliding_attention": ("local_rope_theta", 10_000.0),
}


def _global_every(config: dict, layers: int) -> int:
    """Every how many layers one is global (``layer_types``, or the older ``global_attn_every_n_layers``)."""
    types = config.get("layer_types")
    if not types:
        return int(config.get("global_attn_every_n_layers", 3))
    every = next(
        (
            k
            for k in range(1, layers + 1)
            if all((i % k == 0) == (t == "full_attention") for i, t in enumerate(types))
        ),
        None,
    )
    if every is None or len(types) != layers:
        raise ConfigError(
            f"config.json's layer_types {types} is not a global layer every k from the first: not supported"
        )
    return every


def _theta(config: dict, kind: str) -> float:
    legacy, default = THETA[kind]
    rope = (config.get("rope_parameters") or {}).get(kind) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"config.json's {kind} rope_type {rope['rope_type']!r}: only default rotary positions"
        )
    return float(rope.get("rope_theta", config.get(legacy, default)))


def fields(config: dict) -> dict:
    if any(config.get(k) for k in ("norm_bias", "attention_bias", "mlp_bias")):
        raise ConfigError(
            "config.json has norm_bias, attention_bias or mlp_bias: ModernBERT with biases is not supported"
        )
    layers = config.get("num_hidden_layers", 22)
    return present(
        {
            "d_model": config.get("hidden_size"),
            "nhead": config.get("num_attention_heads"),
            "dim_feedforward": config.get("intermediate_size"),
            "num_layers": config.get("num_hidden_layers"),
            "layer_norm_eps": config.get("norm_eps", 1e-5),
            "activation": activation(config.get("hidden_activation", "gelu"), "hidden_activation"),
            "norm_first": True,
            "feed_forward": "gated",
            "bias": False,
            "first_attention_norm": False,
            "rotary_theta": _theta(config, "full_attention"),
            "rotary_theta_local": _theta(config, "sliding_attention"),
            "attention_window": int(config.get("local_attention", 128)) // 2,
            "global_every": _global_every(config, layers),
        }
    )


def text(config: dict) -> dict:
    return {
        "vocab_size": config["vocab_size"],
        "max_positions": config.get("max_position_embeddings", 8192),
        "type_vocab_size": 0,
        "pad_token_id": config.get("pad_token_id", 50283),
        "positions": "none",
        "layer_norm_eps": config.get("norm_eps", 1e-5),
        "norm_bias": False,
    }


FAMILY = Family(
    "ModernBERT",
    ("modernbert",),
    LAYER_KEYS,
    QKV,
    EMBEDDINGS,
    fields,
    text,
    stack_keys={"norm.weight": "final_norm.weight"},
    bias=False,
    first_layer_lacks=("norm1.weight",),
)
