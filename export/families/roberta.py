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


FAMILY = Family(
    "RoBERTa",
    ("roberta", "xlm-roberta"),
    bert.BERT_LAYER_KEYS,
    bert.BERT_QKV,
    bert.BERT_EMBEDDINGS,
    bert.fields,
    text,
)
