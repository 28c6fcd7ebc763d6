"""RoBERTa and XLM-RoBERTa (multilingual-e5, bge-m3): BERT's layers; positions numbered after the padding index."""

from __future__ import annotations

from addnorm.export.families import Family, bert


def text(config: dict) -> dict:
    return {
        **bert.text(config),
        "type_vocab_size": config.get("type_vocab_size", 1),
        "pad_token_id": config.get("pad_token_id", 1),
        "positions": "after_padding",
    }


# RobertaClassificationHead (XLM-RoBERTa's and MPNet's too): a dense layer and tanh on the first token, out_proj
CLASSIFICATION_HEAD_KEYS = {
    "head.dense.weight": "classifier.dense.weight",
    "head.dense.bias": "classifier.dense.bias",
    "head.out.weight": "classifier.out_proj.weight",
    "head.out.bias": "classifier.out_proj.bias",
}
# RobertaLMHead (XLM-RoBERTa's and MPNet's too): dense, GELU (always), layer_norm, then the decoder
LM_HEAD_KEYS = {
    "head.dense.weight": "lm_head.dense.weight",
    "head.dense.bias": "lm_head.dense.bias",
    "head.norm.weight": "lm_head.layer_norm.weight",
    "head.norm.bias": "lm_head.layer_norm.bias",
    "head.decoder.weight": "lm_head.decoder.weight",
    "head.decoder.bias": "lm_head.bias",
}
FAMILY = Family(
    "RoBERTa",
    ("roberta", "xlm-roberta"),
    bert.BERT_LAYER_KEYS,
    bert.BERT_QKV,
    bert.BERT_EMBEDDINGS,
    bert.fields,
    text,
    head_keys=CLASSIFICATION_HEAD_KEYS,
    sparse_keys=LM_HEAD_KEYS,
    sparse_activation="gelu",
)
