"""MPNet (all-mpnet-base-v2, sentence-transformers' recommended general-purpose model): BERT's block under its own
names, no token types, RoBERTa's positions (numbered after the padding index), and a relative position bias that
the stack computes once from the positions and every layer adds to its attention scores (model/attention.py)."""

from __future__ import annotations

from addnorm.export.families import Family, bert, roberta
from addnorm.model.attention import RELATIVE_BUCKETS
from addnorm.model.config import ConfigError

LAYER_KEYS = {  # the attention's own names; the feed-forward half is BERT's
    "self_attn.out_proj.weight": "attention.attn.o.weight",
    "self_attn.out_proj.bias": "attention.attn.o.bias",
    "norm1.weight": "attention.LayerNorm.weight",
    "norm1.bias": "attention.LayerNorm.bias",
    **{k: v for k, v in bert.BERT_LAYER_KEYS.items() if k.startswith(("linear", "norm2"))},
}
QKV = ("attention.attn.q", "attention.attn.k", "attention.attn.v")
EMBEDDINGS = {part: part for part in ("word_embeddings", "position_embeddings", "LayerNorm")}
STACK_KEYS = {"relative_attention_bias.weight": "encoder.relative_attention_bias.weight"}


def fields(config: dict) -> dict:
    # transformers' MPNetEncoder computes 32 buckets whatever the config says; a table of another size would be
    # indexed past its end or in part
    buckets = config.get("relative_attention_num_buckets", RELATIVE_BUCKETS)
    if buckets != RELATIVE_BUCKETS:
        raise ConfigError(
            f"config.json has relative_attention_num_buckets {buckets!r}; transformers' MPNet computes "
            f"{RELATIVE_BUCKETS} buckets, so only {RELATIVE_BUCKETS} is supported"
        )
    return {**bert.fields(config), "relative_attention_buckets": RELATIVE_BUCKETS}


def text(config: dict) -> dict:
    # MPNetEmbeddings fixes its padding index at 1 and has no token type table
    return {**roberta.text(config), "type_vocab_size": 0, "pad_token_id": 1}


FAMILY = Family(
    "MPNet",
    ("mpnet",),
    LAYER_KEYS,
    QKV,
    EMBEDDINGS,
    fields,
    text,
    STACK_KEYS,
    head_keys=roberta.CLASSIFICATION_HEAD_KEYS,
    sparse_keys=roberta.LM_HEAD_KEYS,
    sparse_activation="gelu",
)
