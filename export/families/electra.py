"""ELECTRA (the ms-marco-electra cross-encoders, ELECTRA-based classifiers and embedders): BERT's layers and embedding
layer; its classification head is a dense layer, GELU and ``out_proj`` on the first token, its masked-LM head the
generator's. An embedding width other than the block's (``embedding_size`` != ``hidden_size``: ELECTRA-small's projection
between the two) is refused."""

from __future__ import annotations

from addnorm.export.families import Family, bert, roberta
from addnorm.model.config import ConfigError


def fields(config: dict) -> dict:
    width, hidden = config.get("embedding_size"), config.get("hidden_size")
    if width is not None and hidden is not None and width != hidden:
        raise ConfigError(
            f"config.json has embedding_size {width} and hidden_size {hidden}: ELECTRA's projection between its "
            "embeddings and its layers (embeddings_project) is not supported; a checkpoint whose two are equal is"
        )
    return bert.fields(config)


# ElectraForMaskedLM (a generator as wide as its embeddings): generator_predictions' dense, GELU (always) and
# LayerNorm, then generator_lm_head (tied to the word embeddings)
SPARSE_KEYS = {
    "head.dense.weight": "generator_predictions.dense.weight",
    "head.dense.bias": "generator_predictions.dense.bias",
    "head.norm.weight": "generator_predictions.LayerNorm.weight",
    "head.norm.bias": "generator_predictions.LayerNorm.bias",
    "head.decoder.weight": "generator_lm_head.weight",
    "head.decoder.bias": "generator_lm_head.bias",
}
FAMILY = Family(
    "ELECTRA",
    ("electra",),
    bert.BERT_LAYER_KEYS,
    bert.BERT_QKV,
    bert.BERT_EMBEDDINGS,
    fields,
    bert.text,
    # ElectraClassificationHead: RoBERTa's key names (classifier.dense, classifier.out_proj), GELU between them
    head_keys=roberta.CLASSIFICATION_HEAD_KEYS,
    head_activation="gelu",
    sparse_keys=SPARSE_KEYS,
    sparse_activation="gelu",
)
