"""Feeding a packed graph (``config.packed``): sequences of different lengths laid end to end, without padding.

A padded graph computes every position of a (B, S, E) batch, so a batch merging a 10-token request with a
200-token one computes 190 positions of padding in every weight product, feed-forward layer and norm. A packed
graph computes those per-token steps on the real tokens only and pads them around attention alone
(``model.encoder.Packing``). Its inputs are Triton's ragged batching layout (model.contract): the tokens
concatenated, flat, and where each sequence starts (``offsets``, in elements) and how long the longest is
(``longest``, by its shape). Its outputs are padded like a padded graph's, zeros beyond each sequence.

Everything else speaks padded batches: the engine, the gate, the golden check. ``feed`` turns one into a packed
graph's inputs, each row computed to its own length (``lengths``; the whole row by default, which is what makes
a packed graph's answers comparable position by position with torch's on the same padded batch). The server
computes each row to ``real_lengths``: neither the padding merging adds nor a request's own trailing padding. It
queues a request's rows cut to their real lengths (``pieces``, ``joined``), which a padded graph needs for that and
a packed one for its attention (padded to a run's longest); those positions answer zeros (``answered``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from addnorm.model.contract import EMBEDDINGS, LONGEST, MASK, OFFSETS, positional


def feed(x: np.ndarray, mask: np.ndarray, lengths: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A packed graph's inputs for the padded batch ``x`` (B, S, E) with ``mask`` (B, S): row ``i``'s first
    ``lengths[i]`` positions (every position when None), end to end. The run's outputs are (B, S, ...)."""
    rows, seq, width = x.shape
    if lengths is None or bool((lengths == seq).all()):
        lengths = np.full(rows, seq, np.int64)
        tokens, token_mask = x.reshape(-1), mask.reshape(-1)
    else:
        keep = np.arange(seq)[None, :] < lengths[:, None]
        tokens, token_mask = x[keep].reshape(-1), mask[keep]
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(lengths * width, out=offsets[1:])
    return {
        EMBEDDINGS: np.ascontiguousarray(tokens),
        MASK: np.ascontiguousarray(token_mask),
        OFFSETS: offsets,
        LONGEST: np.empty(seq * width, np.int32),  # never read: its shape says the padded length
    }


def real_lengths(mask: np.ndarray) -> np.ndarray:
    """Each row's length less its trailing padding (``mask`` (B, S), true = padding; a tokenizer pads on the right):
    what a packed graph need compute of it. A row of padding only keeps its whole length."""
    return mask.shape[1] - np.argmax(~mask[:, ::-1], axis=1)


def is_packed(session: Any) -> bool:
    """Whether an onnxruntime session runs a packed graph (it takes ``offsets``)."""
    return any(i.name == OFFSETS for i in session.get_inputs())


class PaddedFeeds:
    """An onnxruntime session of a packed graph that takes padded feeds, ``{embeddings (B, S, E), mask (B, S)}``,
    as the gate and the tools give every graph: each row is computed whole. Everything else is the session's."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def run(self, names: Any, inputs: dict[str, np.ndarray], options: Any = None) -> list[np.ndarray]:
        return self.session.run(names, feed(inputs[EMBEDDINGS], inputs[MASK]), options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


# A request's rows queue in at most this many pieces (the scheduler's work grows with the queue).
MAX_PIECES = 8
Piece = tuple[np.ndarray, int]  # a request's rows (their indices) and the length they are cut to


def pieces(mask: np.ndarray, most: int = MAX_PIECES) -> list[Piece] | None:
    """A padded request (``mask`` (B, S)) as pieces, its rows grouped by real length, each cut to its group's
    longest, queued apart (the batcher merges near lengths by cost). Rows of one
    length share a piece; past ``most`` lengths, runs of near lengths do (cut at the widest gaps between them; a
    shorter row's own padding in such a piece is computed, masked). None when no row has trailing padding."""
    lengths = real_lengths(mask)
    if bool((lengths == mask.shape[1]).all()):
        return None
    tops = np.unique(lengths)  # ascending; each group's longest, once grouped
    if len(tops) > most:
        widest = np.sort(np.argsort(-np.diff(tops), kind="stable")[: most - 1])
        tops = np.append(tops[widest], tops[-1])
    group = np.searchsorted(tops, lengths)  # each row's: the shortest top that holds it
    return [
        (np.flatnonzero(group == g), int(tops[g])) for g in range(len(tops) - 1, -1, -1) if (group == g).any()
    ]


def joined(
    mask: np.ndarray, parts: list[Piece], answers: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The answer to a request with ``mask`` (B, S) from its ``pieces``' answers: zeros beyond each row's length
    (a shorter row's padding computed within a piece set to zero too)."""
    lengths = real_lengths(mask)
    shared = any(bool((lengths[rows] < n).any()) for rows, n in parts)  # rows of several lengths in a piece
    out = {}
    for name, first in answers[0].items():
        cut = positional(name)  # (B, S, ...); else (B, ...)
        whole = np.zeros((*mask.shape[: 2 if cut else 1], *first.shape[2 if cut else 1 :]), first.dtype)
        for (rows, n), answer in zip(parts, answers, strict=True):
            whole[(rows, slice(0, n)) if cut else rows] = answer[name]
        if cut and shared:
            whole[np.arange(mask.shape[1]) >= lengths[:, None]] = 0
        out[name] = whole
    return out


def answered(out: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """A positional output (B, S, ...) of a padded run as the server answers it (a copy if masked): zeros beyond
    each row's real length, the trailing padding no graph computes there (``pieces``, ``feed``)."""
    if mask is None:
        return out
    out = np.array(out)
    out[np.arange(mask.shape[1]) >= real_lengths(np.asarray(mask, bool))[:, None]] = 0
    return out
