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
computes each row to ``real_lengths``: neither the padding merging adds nor a request's own trailing padding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from model.contract import EMBEDDINGS, LONGEST, MASK, OFFSETS


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
