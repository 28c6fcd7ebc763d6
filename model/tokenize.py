"""Text -> token ids with the artifact's own tokenizer.json (Hugging Face ``tokenizers``, Rust; no torch, no
transformers), the way sentence-transformers feeds the model: special tokens added, at most ``max_length`` tokens,
padded to the longest input of the batch. The server's and the export's reference check's one tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from addnorm.model.text import TextConfig

# Real text runs far under this many characters a token (English about 4-5, code 3, CJK 1-2). A longer text is
# refused (or, asked to truncate, cut) before it is tokenized: tokenizing costs time and memory by the character,
# and one huge string must not cost the server more than max_length x this many characters of work.
MAX_CHARS_PER_TOKEN = 32
# One text up to this long is tokenized by encode, cheaper for a sentence; a longer one, and several texts, by
# encode_batch, which lets go of the GIL while it works (the inference threads' Python runs meanwhile).
BATCH_CHARS = 4096
DIRECTIONS = ("right", "left")  # where truncation cuts: the end of an input, or its start


class TooManyChars(ValueError):
    """An input is longer in characters than ``max_length`` tokens can be (``MAX_CHARS_PER_TOKEN``); ``truncated``:
    it was cut to ``limit`` and still held fewer tokens than the model takes, so the cut would decide the answer."""

    def __init__(self, index: int, chars: int, limit: int, truncated: bool = False) -> None:
        self.index, self.chars, self.limit, self.truncated = index, chars, limit, truncated
        self.reason = (
            f"and its first {limit} hold fewer tokens than the model takes, so where a cut falls would change "
            "the answer"
            if truncated
            else f"more than the model's max_length tokens can hold (at most {limit})"
        )
        super().__init__(f"input {index} has {chars} characters, {self.reason}")


class QueryTooLong(ValueError):
    """A pair's first text (a query) alone takes more tokens than the model's length: truncation cuts only the second
    (the document), so the pair cannot be made to fit."""

    def __init__(self, index: int, limit: int) -> None:
        super().__init__(f"pair {index}'s first text alone takes more than this model's {limit} tokens")
        self.index, self.limit = index, limit


class TooLong(ValueError):
    """An input has more tokens than the model takes (or the request's own ``max_tokens``: ``asked``) and the
    caller did not ask to truncate."""

    def __init__(self, index: int, tokens: int, limit: int, asked: bool = False) -> None:
        whose = "max_tokens" if asked else "this model's"
        super().__init__(
            f"input {index} has {tokens} tokens, more than {whose} {limit}: shorten it, or ask for truncation"
        )
        self.index, self.tokens, self.limit, self.asked = index, tokens, limit, asked


@dataclass(frozen=True)
class Batch:
    """Padded token ids of a batch of inputs (right-padded with the padding id)."""

    input_ids: np.ndarray  # (B, S) int64
    token_type_ids: np.ndarray  # (B, S) int64
    mask: np.ndarray  # (B, S) bool, true = padding (the block's mask)
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padding(self) -> np.ndarray | None:
        """``mask`` where some input is padded, None where none is (one input, or all of one length): what a
        batcher needs, with no array to read where there is no padding (a numpy call costs 10-20 µs on a lone
        request's path, run cold after a model's run)."""
        return None if min(self.lengths) == max(self.lengths) else self.mask


class TextTokenizer:
    """``tokenizer.json`` (its bytes) with the artifact's limits. Its own padding and truncation settings (a
    sentence-transformers export often fixes both at 128) are turned off: the batch is padded to its longest input
    here, and ``max_length`` (the manifest's) is the limit."""

    def __init__(self, tokenizer_json: bytes | str, text: TextConfig) -> None:
        raw = tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json
        self.text = text
        self._plain = Tokenizer.from_str(raw)
        self._plain.no_padding()
        self._plain.no_truncation()
        # cut to max_length, by direction (TEI's truncation_direction: right cuts the end, left the start); a pair
        # (a query and a document) is cut in its second text only, never the query (TEI's rerank)
        self._cut, self._cut_second = {}, {}
        for direction in DIRECTIONS:
            self._cut[direction] = Tokenizer.from_str(raw)
            self._cut[direction].no_padding()
            self._cut[direction].enable_truncation(text.max_length, direction=direction)
            self._cut_second[direction] = Tokenizer.from_str(raw)
            self._cut_second[direction].no_padding()
            self._cut_second[direction].enable_truncation(
                text.max_length, strategy="only_second", direction=direction
            )
        # the tokens the model's template adds to a text ([CLS] and [SEP]): a shorter limit keeps them (max_tokens)
        self.specials = len(self._plain.encode("").ids)

    @property
    def max_chars(self) -> int:
        """The longest text, in characters, this model's ``max_length`` tokens can hold (``MAX_CHARS_PER_TOKEN``)."""
        return self.text.max_length * MAX_CHARS_PER_TOKEN

    def within(
        self, texts: list[str], truncate: bool = False, direction: str = "right"
    ) -> tuple[list[str], list[int]]:
        """``texts`` checked against ``max_chars`` before any is tokenized: TooManyChars for one over it, or, when
        ``truncate``, cut to it at the last space in its final eighth (a word's boundary, so the tokens before the
        cut are the whole text's; ``direction`` left: its last ``max_chars`` from the first space in their first
        eighth, the tokens after the cut the whole text's). Also the indices of the texts cut."""
        cap, cut = self.max_chars, []
        for i, text in enumerate(texts):
            if len(text) > cap:
                if not truncate:
                    raise TooManyChars(i, len(text), cap)
                cut.append(i)
        if not cut:
            return texts, cut
        texts = list(texts)
        for i in cut:
            if direction == "left":
                tail = texts[i][-cap:]
                space = tail.find(" ", 0, cap // 8)
                texts[i] = tail[space + 1 :] if space >= 0 else tail
                continue
            head = texts[i][:cap]
            space = head.rfind(" ", cap - cap // 8)
            texts[i] = head[:space] if space > 0 else head
        return texts, cut

    def encode(
        self,
        texts: list[str],
        truncate: bool = False,
        seconds: list[str] | None = None,
        direction: str = "right",
    ) -> Batch:
        """Tokenize ``texts`` into a padded batch (TooLong for an input over ``max_length`` unless ``truncate``);
        with ``seconds``, each text paired with its second (``ids``)."""
        return self.pad(*self.ids(texts, truncate, seconds, direction))

    def ids(
        self,
        texts: list[str],
        truncate: bool = False,
        seconds: list[str] | None = None,
        direction: str = "right",
        max_tokens: int | None = None,
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Each of ``texts``' token ids and token type ids, unpadded (TooLong as ``encode``; TooManyChars for a
        text over ``max_chars``, checked before tokenizing: ``within``). With ``seconds``, one per text, each
        text and its second as a pair (the tokenizer's pair template: a cross-encoder's query and document); cut,
        when ``truncate``, in the second only (QueryTooLong when the first alone is over the length). ``direction``:
        where a cut falls (DIRECTIONS). ``max_tokens``, a limit of the caller's below the model's: a text alone
        (more than ``specials``) at most that many tokens, special tokens included, kept as the tokenizer's own
        truncation keeps them; a pair's second text at most that many of its own tokens (Cohere's
        max_tokens_per_doc), cut whatever ``truncate`` says."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if seconds is not None:
            return self._pairs(texts, seconds, truncate, direction, max_tokens)
        if max_tokens is not None and not self.specials < max_tokens:
            raise ValueError(f"max_tokens must be more than the model's {self.specials} special tokens")
        whole = texts
        texts, cut = self.within(texts, truncate, direction)
        tokenizer = self._cut[direction] if truncate else self._plain
        # One short input on the caller's thread: encode_batch lets go of the GIL and must win it back, a wait as long
        # as the interpreter's switch interval when another thread runs Python (the server's inference thread). A long
        # one goes through encode_batch, which holds no GIL while it works.
        if len(texts) == 1 and len(texts[0]) <= BATCH_CHARS:
            encodings = [tokenizer.encode(texts[0])]
        else:
            encodings = tokenizer.encode_batch(texts)
        ids, types = self._checked(encodings, cut, whole, truncate)
        if max_tokens is not None and max_tokens < self.text.max_length:
            for i, row in enumerate(ids):
                if len(row) > max_tokens:
                    if not truncate:
                        raise TooLong(i, len(row), max_tokens, asked=True)
                    ids[i], types[i] = _shortened(encodings[i], max_tokens, direction)
        return ids, types

    def _checked(
        self, encodings: list, cut: list[int], whole: list[str], truncate: bool
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The encodings' ids and type ids, once no input is too long (TooLong, unless ``truncate``) and no text
        ``cut`` to ``max_chars`` (``whole``: as given) came out short of the limit (the cut decided the answer)."""
        ids = [e.ids for e in encodings]
        for i in cut:
            if len(ids[i]) < self.text.max_length:
                raise TooManyChars(i, len(whole[i]), self.max_chars, truncated=True)
        if not truncate:
            for i, row in enumerate(ids):
                if len(row) > self.text.max_length:
                    raise TooLong(i, len(row), self.text.max_length)
        return ids, [e.type_ids for e in encodings]

    def _pairs(
        self,
        firsts: list[str],
        seconds: list[str],
        truncate: bool,
        direction: str = "right",
        max_tokens: int | None = None,
    ) -> tuple[list[list[int]], list[list[int]]]:
        if len(firsts) != len(seconds):
            raise ValueError(f"{len(firsts)} first texts for {len(seconds)} second ones")
        try:
            self.within(firsts)  # a query is never cut
        except TooManyChars as exc:
            raise QueryTooLong(exc.index, self.text.max_length) from None
        whole = seconds
        seconds, cut = self.within(seconds, truncate, direction)
        tokenizer = self._cut_second[direction] if truncate else self._plain
        try:
            encodings = tokenizer.encode_batch(list(zip(firsts, seconds, strict=True)))
        except (
            Exception
        ):  # tokenizers' "second sequence not long enough to be truncated": the query is too long
            alone = self._plain.encode_batch(firsts)
            index = next((i for i, e in enumerate(alone) if len(e.ids) >= self.text.max_length), 0)
            raise QueryTooLong(index, self.text.max_length) from None
        ids, types = self._checked(encodings, cut, whole, truncate)
        if max_tokens is not None:
            for i, e in enumerate(encodings):
                second = [p for p, sequence in enumerate(e.sequence_ids) if sequence == 1]
                if len(second) > max_tokens:
                    drop = set(second[max_tokens:] if direction == "right" else second[:-max_tokens])
                    ids[i] = [t for p, t in enumerate(ids[i]) if p not in drop]
                    types[i] = [t for p, t in enumerate(types[i]) if p not in drop]
        return ids, types

    def tokens(self, texts: list[str], special: bool = True) -> list[list[tuple[int, str, bool, int, int]]]:
        """Each input's tokens as (id, text, special, start, stop), the offsets in characters of the input (TEI's
        /tokenize); ``special``: with the special tokens the model adds. TooManyChars for a text over ``max_chars``."""
        self.within(texts)
        encodings = self._plain.encode_batch(texts, add_special_tokens=special)
        return [
            [
                (i, t, bool(sp), s, f)
                for i, t, sp, (s, f) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)
            ]
            for e in encodings
        ]

    @property
    def vocab_size(self) -> int:
        """Token ids below this are the model's (its added tokens included)."""
        return self._plain.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[list[int]], skip_special: bool = True, clean_up: bool = False) -> list[str]:
        """Each id list's text, as the tokenizer's decoder joins its tokens (TEI's /decode: tokenizers' ``decode``);
        ``skip_special``: without the special tokens ([CLS], [PAD]...); ``clean_up``: then transformers' clean-up of
        spaces (its ``clean_up_tokenization``, where the model's config asks for it: ``text.clean_up_spaces``).
        Ids must be below ``vocab_size`` (tokenizers drops the others without a word)."""
        texts = self._plain.decode_batch(ids, skip_special_tokens=skip_special)
        return [_clean_up(text) for text in texts] if clean_up else texts

    def pad(self, ids: list[list[int]], type_ids: list[list[int]] | None = None) -> Batch:
        """Token id lists -> a padded batch."""
        lengths = [len(row) for row in ids]
        seq = max(lengths)
        if min(lengths) == seq:  # nothing to pad (one input, or all of one length): the lists as they are
            batch = np.array(ids, np.int64)
            types = np.zeros_like(batch) if type_ids is None else np.array(type_ids, np.int64)
            return Batch(batch, types, np.zeros(batch.shape, bool), lengths)
        batch = np.full((len(ids), seq), self.text.pad_token_id, np.int64)
        types = np.zeros((len(ids), seq), np.int64)
        for i, row in enumerate(ids):
            batch[i, : len(row)] = row
            if type_ids is not None:
                types[i, : len(row)] = type_ids[i]
        mask = np.arange(seq)[None, :] >= np.array(lengths)[:, None]
        return Batch(batch, types, mask, lengths)


# transformers' ``clean_up_tokenization``: its decode's spaces before punctuation and English contractions removed
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _clean_up(text: str) -> str:
    for space, joined in _CLEAN_UP:
        text = text.replace(space, joined)
    return text


def _shortened(encoding, limit: int, direction: str) -> tuple[list[int], list[int]]:
    """One text's ids and type ids cut to ``limit``, special tokens included: its leading and trailing special
    tokens kept and its own tokens cut at their end (``right``) or start (``left``), as the tokenizer's own
    truncation at ``limit`` cuts them (tests/model/test_tokenize.py holds the two equal)."""
    special, ids, types = encoding.special_tokens_mask, encoding.ids, encoding.type_ids
    lead = next((i for i, s in enumerate(special) if not s), len(special))
    trail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    body = len(ids) - lead - trail
    keep = limit - lead - trail
    start, stop = (lead, lead + keep) if direction == "right" else (lead + body - keep, lead + body)
    end = len(ids) - trail
    return ids[:lead] + ids[start:stop] + ids[end:], types[:lead] + types[start:stop] + types[end:]
