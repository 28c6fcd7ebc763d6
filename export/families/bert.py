"""BERT (and the checkpoints built on it: MiniLM, BGE, E5, GTE): post-norm, absolute positions, token types."""

from __future__ import annotations

from addnorm.export.families import Family, activation, present

BERT_LAYER_KEYS = {  # encoder block key -> BertLayer key
    "self_attn.out_proj.weight": "attention.output.dense.weight",
    "self_attn.out_proj.bias": "attention.output.dense.bias",
    "norm1.weight": "attention.output.LayerNorm.weight",
    "norm1.bias": "attention.output.LayerNorm.bias",
    "linear1.weight": "intermediate.dense.weight",
    "linear1.bias": "intermediate.dense.bias",
    "linear2.weight": "output.dense.weight",
    "linear2.bias": "output.dense.bias",
    "norm2.weight": "output.LayerNorm.weight",
    "norm2.bias": "output.LayerNorm.bias",
}
BERT_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
BERT_EMBEDDINGS = {
    part: part for part in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")
}


def fields(config: dict) -> dict:
    return present(
        {
            "d_model": config.get("hidden_size"),
            "nhead": config.get("num_attention_heads"),
            "dim_feedforward": config.get("intermediate_size"),
            "num_layers": config.get("num_hidden_layers"),
            "layer_norm_eps": config.get("layer_norm_eps"),
            "activation": activation(config.get("hidden_act", "gelu")),
            "norm_first": False,  # post-norm
        }
    )


def text(config: dict) -> dict:
    return {
        "vocab_size": config["vocab_size"],
        "max_positions": config.get("max_position_embeddings", 512),
        "type_vocab_size": config.get("type_vocab_size", 2),
        "pad_token_id": config.get("pad_token_id", 0) or 0,
        "positions": "absolute",
        "layer_norm_eps": config.get("layer_norm_eps", 1e-12),
    }


# BertForSequenceClassification: the pooler (a dense layer and tanh on the first token), then the classifier
BERT_HEAD_KEYS = {
    "head.dense.weight": "pooler.dense.weight",
    "head.dense.bias": "pooler.dense.bias",
    "head.out.weight": "classifier.weight",
    "head.out.bias": "classifier.bias",
}
# BertForMaskedLM: the prediction head's transform (dense, hidden_act, LayerNorm), then the decoder
BERT_SPARSE_KEYS = {
    "head.dense.weight": "cls.predictions.transform.dense.weight",
    "head.dense.bias": "cls.predictions.transform.dense.bias",
    "head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "head.decoder.weight": "cls.predictions.decoder.weight",
    "head.decoder.bias": "cls.predictions.bias",
}
FAMILY = Family(
    "BERT",
    ("bert",),
    BERT_LAYER_KEYS,
    BERT_QKV,
    BERT_EMBEDDINGS,
    fields,
    text,
    head_keys=BERT_HEAD_KEYS,
    sparse_keys=BERT_SPARSE_KEYS,
)
