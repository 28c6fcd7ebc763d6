"""DistilBERT: its own layer names, no token types, absolute positions, eps 1e-12."""

from __future__ import annotations

from addnorm.export.families import Family, activation, present

LAYER_KEYS = {
    "self_attn.out_proj.weight": "attention.out_lin.weight",
    "self_attn.out_proj.bias": "attention.out_lin.bias",
    "norm1.weight": "sa_layer_norm.weight",
    "norm1.bias": "sa_layer_norm.bias",
    "linear1.weight": "ffn.lin1.weight",
    "linear1.bias": "ffn.lin1.bias",
    "linear2.weight": "ffn.lin2.weight",
    "linear2.bias": "ffn.lin2.bias",
    "norm2.weight": "output_layer_norm.weight",
    "norm2.bias": "output_layer_norm.bias",
}
QKV = ("attention.q_lin", "attention.k_lin", "attention.v_lin")
EMBEDDINGS = {
    "word_embeddings": "word_embeddings",
    "position_embeddings": "position_embeddings",
    "LayerNorm": "LayerNorm",
}
EPS = 1e-12  # transformers' DistilBERT: fixed, not in config.json


def fields(config: dict) -> dict:
    if config.get("sinusoidal_pos_embds"):
        from addnorm.model.config import ConfigError

        raise ConfigError(
            "config.json has sinusoidal_pos_embds: its positions are computed, not a table; not supported"
        )
    return present(
        {
            "d_model": config.get("dim"),
            "nhead": config.get("n_heads"),
            "dim_feedforward": config.get("hidden_dim"),
            "num_layers": config.get("n_layers"),
            "layer_norm_eps": EPS,
            "activation": activation(config.get("activation", "gelu"), "activation"),
            "norm_first": False,
        }
    )


def text(config: dict) -> dict:
    return {
        "vocab_size": config["vocab_size"],
        "max_positions": config.get("max_position_embeddings", 512),
        "type_vocab_size": 0,
        "pad_token_id": config.get("pad_token_id", 0) or 0,
        "positions": "absolute",
        "layer_norm_eps": EPS,
    }


# DistilBertForSequenceClassification: pre_classifier and relu on the first token, then the classifier
HEAD_KEYS = {
    "head.dense.weight": "pre_classifier.weight",
    "head.dense.bias": "pre_classifier.bias",
    "head.out.weight": "classifier.weight",
    "head.out.bias": "classifier.bias",
}
# DistilBertForMaskedLM: vocab_transform, the activation, vocab_layer_norm, vocab_projector
SPARSE_KEYS = {
    "head.dense.weight": "vocab_transform.weight",
    "head.dense.bias": "vocab_transform.bias",
    "head.norm.weight": "vocab_layer_norm.weight",
    "head.norm.bias": "vocab_layer_norm.bias",
    "head.decoder.weight": "vocab_projector.weight",
    "head.decoder.bias": "vocab_projector.bias",
}
FAMILY = Family(
    "DistilBERT",
    ("distilbert",),
    LAYER_KEYS,
    QKV,
    EMBEDDINGS,
    fields,
    text,
    head_keys=HEAD_KEYS,
    head_activation="relu",
    sparse_keys=SPARSE_KEYS,
)
