"""How one encoder's output on real tokens compares with another's (transformers', as a rule): the largest
difference, each sentence's cosine of its mean-pooled vectors, and whether every pair of sentences ranks the same."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pooled(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over each sequence's real tokens (sentence-transformers' mean pooling), (N, E) float64."""
    keep = (~mask)[..., None].astype(np.float64)
    return (x.astype(np.float64) * keep).sum(1) / np.maximum(keep.sum(1), 1.0)


def sentence_cosines(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Cosine of each sequence's mean-pooled embedding in ``a`` with its own in ``b``."""
    pa, pb = pooled(a, mask), pooled(b, mask)
    return (pa * pb).sum(1) / np.maximum(np.linalg.norm(pa, axis=1) * np.linalg.norm(pb, axis=1), 1e-300)


def ranking_spearman(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """Spearman correlation of the pairwise cosine similarities of the sentences under ``a`` and under ``b``:
    1.0 when every pair ranks the same (what retrieval users need to hold)."""

    def similarities(x: np.ndarray) -> np.ndarray:
        p = pooled(x, mask)
        p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-300)
        return (p @ p.T)[np.triu_indices(len(p), 1)]

    sa, sb = similarities(a), similarities(b)
    if sa.size < 2:
        return 1.0
    ra, rb = np.argsort(np.argsort(sa)), np.argsort(np.argsort(sb))
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass(frozen=True)
class Agreement:
    """How one encoder's output on real tokens compares with transformers'."""

    max_abs: float  # over real (unpadded) tokens
    min_sentence_cosine: float
    spearman: float
    sentences: int
    tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def agreement(out: np.ndarray, want: np.ndarray, mask: np.ndarray) -> Agreement:
    keep = ~mask
    diff = np.abs(out.astype(np.float64) - want.astype(np.float64))[keep]
    return Agreement(
        max_abs=float(diff.max()) if diff.size else 0.0,
        min_sentence_cosine=float(sentence_cosines(out, want, mask).min()),
        spearman=ranking_spearman(out, want, mask),
        sentences=int(out.shape[0]),
        tokens=int(keep.sum()),
    )


TOP_K = 3  # a reranker's top documents, whose overlap a user reads


def scores_agreement(got: np.ndarray, want: np.ndarray) -> dict:
    """How a classification head's scores (N, labels) agree with another's: the largest difference, the cosine of
    the two as flat vectors, and what a user reads of them: with one label (a cross-encoder's relevance) the
    Spearman correlation of the N scores' ranks and the overlap of the top 3, with several the share of rows whose
    top label is the same."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norms = np.linalg.norm(got) * np.linalg.norm(want)
    # each label's scores less their mean over the rows: what tells the rows apart, which a common offset of the
    # logits would otherwise hide from the cosine (a GELU head computed as relu: 0.99999 flat, 0.93 Spearman)
    dg, dw = got - got.mean(0), want - want.mean(0)
    spread = np.linalg.norm(dg) * np.linalg.norm(dw)
    out = {
        "scores_max_abs": float(np.abs(got - want).max()) if got.size else 0.0,
        "scores_cosine": float((got * want).sum() / norms) if norms > 0 else 1.0,
        "scores_centered_cosine": float((dg * dw).sum() / spread) if spread > 0 else 1.0,
    }
    if got.shape[-1] == 1:
        ranks = [np.argsort(np.argsort(a[:, 0])) for a in (got, want)]
        out["scores_spearman"] = float(np.corrcoef(*ranks)[0, 1]) if len(got) > 1 else 1.0
        top = [set(np.argsort(-a[:, 0], kind="stable")[:TOP_K]) for a in (got, want)]
        out["top3_overlap"] = len(top[0] & top[1]) / min(TOP_K, len(got))
    else:
        out["label_agreement"] = float((got.argmax(-1) == want.argmax(-1)).mean())
    return out


def sparse_agreement(got: np.ndarray, want: np.ndarray) -> dict:
    """How SPLADE weights (N, vocab) agree with another's: the largest difference, the least per-text cosine, and
    the Jaccard index of each text's non-zero entries (the terms a sparse index stores), its least over the texts."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    cosines = np.where(norms > 0, (got * want).sum(1) / np.where(norms > 0, norms, 1.0), 1.0)
    union = ((got > 0) | (want > 0)).sum(1)
    jaccard = np.where(union > 0, ((got > 0) & (want > 0)).sum(1) / np.maximum(union, 1), 1.0)
    return {
        "sparse_max_abs": float(np.abs(got - want).max()) if got.size else 0.0,
        "sparse_min_cosine": float(cosines.min()) if got.size else 1.0,
        "sparse_min_jaccard": float(jaccard.min()) if got.size else 1.0,
        "sparse_nonzero": int((want > 0).sum(1).mean()) if got.size else 0,
    }


def splade(
    logits: np.ndarray, mask: np.ndarray, pooling: str = "max", activation: str = "relu"
) -> np.ndarray:
    """sentence-transformers' SpladePooling of masked-LM logits (N, S, vocab), float64: log1p(relu) (twice for
    ``log1p_relu``) of the real tokens (``mask`` true = padding), pooled over the sequence by max or sum."""
    values = np.maximum(np.asarray(logits, np.float64), 0.0) * (~np.asarray(mask, bool))[..., None]
    for _ in range(2 if activation == "log1p_relu" else 1):
        values = np.log1p(values)
    return values.max(axis=1) if pooling == "max" else values.sum(axis=1)
