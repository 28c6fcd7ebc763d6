"""Tiny random model directories of each encoder family, built with transformers' own classes and a small
WordPiece tokenizer made with ``tokenizers`` (nothing from a hub): config.json, model.safetensors, tokenizer.json,
and sentence-transformers' modules.json with mean pooling and Normalize, as a real sentence-embedding model has."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "a",
    "man",
    "is",
    "eating",
    "food",
    "bread",
    "the",
    "girl",
    "carrying",
    "baby",
    "riding",
    "white",
    "horse",
    "on",
    "an",
    "enclosed",
    "ground",
    "woman",
    "playing",
    "violin",
    "someone",
    "in",
    "gorilla",
    "costume",
    "set",
    "of",
    "drums",
    "how",
    "do",
    "i",
    "reset",
    "my",
    "password",
    "if",
    "no",
    "longer",
    "have",
    "access",
    "to",
    "email",
    "address",
    "account",
    "what",
    "boiling",
    "point",
    "water",
    "at",
    "high",
    "altitude",
    "quarterly",
    "report",
    "shows",
    "revenue",
    "grew",
    "eight",
    "percent",
    "while",
    "operating",
    "costs",
    "fell",
    "driven",
    "mostly",
    "by",
    "lower",
    "energy",
    "prices",
    "and",
    "smaller",
    "workforce",
    "european",
    "division",
]
# the block of make_model_dir("modernbert") as EncoderConfig's fields: global, local, local; a window of 4 each side
MODERN = dict(
    d_model=32,
    nhead=4,
    dim_feedforward=48,
    num_layers=3,
    activation="gelu",
    norm_first=True,
    feed_forward="gated",
    bias=False,
    first_attention_norm=False,
    rotary_theta=160_000.0,
    rotary_theta_local=10_000.0,
    attention_window=4,
    global_every=3,
)

TEXTS = [
    "A man is eating food.",
    "The girl is carrying a baby.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "a",
    "What is the boiling point of water at high altitude? " * 3,
]
# family -> (transformers config class, its model class, the special tokens in vocabulary order, pad token, template)
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def _tokenizer(specials: tuple[str, ...], cls: str, sep: str, unk: str, pad: str):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {t: i for i, t in enumerate(specials)}
    for w in [*WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789", ".", ",", "?", "!"]:
        vocab.setdefault(w, len(vocab))
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(f"##{c}", len(vocab))
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()  # "##" pieces joined, as a real BERT tokenizer.json decodes
    # a pair as each family's own tokenizer writes it: BERT's second text of token type 1, RoBERTa's </s></s> between
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if cls == "[CLS]" else f"{cls} $A {sep} {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair, special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    tok.enable_padding(
        pad_id=vocab[pad], pad_token=pad, length=16
    )  # as hub exports fix it: the server must not
    tok.enable_truncation(16)
    return tok, len(vocab)


def make_model_dir(
    family: str,
    directory: Path,
    seed: int = 0,
    max_positions: int = 64,
    labels: int = 0,
    sparse: str | None = None,
) -> Path:
    """A tiny random ``family`` model directory (bert, roberta, xlm-roberta, distilbert, mpnet, modernbert, electra): a
    sentence-transformers embedder, or with ``labels`` its ``*ForSequenceClassification`` (one label: a
    cross-encoder; several: a classifier whose labels are named ``label_{i}``), or with ``sparse`` (a SpladePooling
    ``pooling_strategy``: max or sum) a SparseEncoder: its ``*ForMaskedLM`` and SpladePooling."""
    import torch
    import transformers as tf

    if family in ("roberta", "xlm-roberta", "mpnet"):
        tok, vocab = _tokenizer(ROBERTA_SPECIALS, "<s>", "</s>", "<unk>", "<pad>")
        pad = 1
    else:
        tok, vocab = _tokenizer(BERT_SPECIALS, "[CLS]", "[SEP]", "[UNK]", "[PAD]")
        pad = 0
    common = {"vocab_size": vocab, "max_position_embeddings": max_positions, "pad_token_id": pad}
    if family == "distilbert":
        config = tf.DistilBertConfig(dim=32, n_heads=4, hidden_dim=64, n_layers=2, **common)
        cls = tf.DistilBertModel
    elif family == "modernbert":  # three layers: global, local, local; windows of 4 each side (8 in all)
        config = tf.ModernBertConfig(
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=48,
            num_hidden_layers=3,
            local_attention=8,
            global_attn_every_n_layers=3,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
            **common,
        )
        cls = tf.ModernBertModel
    else:
        shape = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2)
        if family == "bert":
            config, cls = tf.BertConfig(**shape, type_vocab_size=2, **common), tf.BertModel
        elif family == "mpnet":  # the relative position bias's 32 buckets, as transformers computes them
            config, cls = tf.MPNetConfig(**shape, relative_attention_num_buckets=32, **common), tf.MPNetModel
        elif family == "electra":  # a discriminator whose embeddings are as wide as its layers
            config, cls = (
                tf.ElectraConfig(**shape, embedding_size=32, type_vocab_size=2, **common),
                tf.ElectraModel,
            )
        elif family == "roberta":
            config, cls = tf.RobertaConfig(**shape, type_vocab_size=1, **common), tf.RobertaModel
        else:
            config, cls = tf.XLMRobertaConfig(**shape, type_vocab_size=1, **common), tf.XLMRobertaModel
    if labels:
        cls = getattr(tf, cls.__name__.replace("Model", "ForSequenceClassification"))
        config.num_labels = labels
        config.id2label = {i: f"label_{i}" for i in range(labels)}
        config.label2id = {f"label_{i}": i for i in range(labels)}
    if sparse:
        cls = getattr(tf, cls.__name__.replace("Model", "ForMaskedLM"))
        config.architectures = [cls.__name__]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # LayerNorms away from 1 and 0: a wrong eps or a swapped gamma shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            if "relative_attention_bias" in name:  # std 0.4, large enough that a wrong bucket shows
                p.mul_(20.0)
            if labels and name.startswith("classifier") and name.endswith("weight") and "dense" not in name:
                p.mul_(300.0)  # logits that differ by units from one text to the next, not by hundredths
        if sparse:  # most of the vocabulary's logits below 0, as a trained SPLADE model's: sparse answers
            bias = model.get_output_embeddings().bias
            bias.copy_(torch.randn_like(bias) * 0.05 - 0.15)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tok.save(str(directory / "tokenizer.json"))
    if (
        pad == 0
    ):  # as older BERT checkpoints ask transformers' decode: "food ." -> "food." (vLLM's /detokenize)
        (directory / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    if labels:
        return directory
    if sparse:
        prefix = "sentence_transformers.sparse_encoder.models."
        (directory / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": prefix + "MLMTransformer"},
                    {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": prefix + "SpladePooling"},
                ]
            )
        )
        (directory / "1_SpladePooling").mkdir(exist_ok=True)
        (directory / "1_SpladePooling" / "config.json").write_text(
            json.dumps(
                {"pooling_strategy": sparse, "activation_function": "relu", "word_embedding_dimension": None}
            )
        )
        (directory / "config_sentence_transformers.json").write_text(
            json.dumps({"model_type": "SparseEncoder"})
        )
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
        return directory
    (directory / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return directory


def transformers_vectors(directory: Path, batch) -> tuple:
    """transformers' AutoModel on a tokenized ``batch``: (last_hidden_state, sentence-transformers' mean pooling
    then Normalize of it), float64."""
    import numpy as np
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        str(directory), local_files_only=True, attn_implementation="eager"
    ).eval()
    feed = {
        "input_ids": torch.from_numpy(batch.input_ids),
        "attention_mask": torch.from_numpy(~batch.mask).long(),
    }
    if model.config.model_type not in ("distilbert", "mpnet", "modernbert"):
        feed["token_type_ids"] = torch.from_numpy(batch.token_type_ids)
    with torch.no_grad():
        hidden = model(**feed).last_hidden_state.double().numpy()
    keep = (~batch.mask)[..., None].astype(np.float64)
    pooled = (hidden * keep).sum(1) / keep.sum(1)
    return hidden, pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


# the least per-sentence cosine of the pooled vectors with sentence-transformers' pooling of transformers' output
COSINE = {"fp32": 0.999999, "fused": 0.999999, "fp16": 0.9999, "int8": 0.999}


def assert_like_transformers(artifact: Path, config, batch, directory: Path, variant: str) -> None:
    """The artifact's graphs on a tokenized ``batch`` against transformers' AutoModel on the same ids: the encoded
    tokens within 4x float32's floor for fp32, and every variant's pooled vectors within its cosine (COSINE)."""
    import numpy as np

    from addnorm.export import hf
    from addnorm.model.contract import ENCODED, POOLED
    from addnorm.model.verdict import float32_floor

    got = hf.run_ids(artifact, config, batch)
    hidden, pooled = transformers_vectors(directory, batch)
    if variant == "fp32":
        err = float(np.abs(got[ENCODED] - hidden)[~batch.mask].max())
        assert err <= 4 * max(float32_floor(hidden), 1e-6), err
    cosine = (got[POOLED] * pooled).sum(1) / np.linalg.norm(got[POOLED], axis=1)
    assert cosine.min() >= COSINE[variant], cosine
