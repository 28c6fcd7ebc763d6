"""The parity gate's inputs: random cases of many sizes, and an adversarial suite. Seeded and reproducible."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    """One parity input: ``offset + scale * N(0, 1)`` of shape (batch, seq, d_model), optionally padded.

    ``pad`` is the fraction of each row's positions (after the first) that are padding; ``constant`` makes
    every feature of a position equal (zero variance); ``all_pad_row`` makes the first row entirely padding.
    ``representative``: a lossy variant's quality (its closeness to fp32) is judged on this input; an adversarial
    input judges only that the graph computes its scheme.
    """

    name: str
    batch: int
    seq: int
    pad: float = 0.0
    offset: float = 0.0
    scale: float = 1.0
    constant: bool = False
    all_pad_row: bool = False
    representative: bool = True

    def condition(self, x: np.ndarray) -> float:
        """How hard the input is for float32 LayerNorm: the largest |mean| / std over positions."""
        mean = np.abs(x.mean(-1, dtype=np.float64))
        std = x.std(-1, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(std > 0, mean / np.maximum(std, 1e-30), np.where(mean > 0, np.inf, 0.0))
        return float(ratio.max())

    def make(self, d_model: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Returns (embeddings (B, S, E) float32, mask (B, S) bool, true = padding)."""
        shape = (self.batch, self.seq, 1 if self.constant else d_model)
        x = self.offset + self.scale * rng.standard_normal(shape)
        x = np.broadcast_to(x, (self.batch, self.seq, d_model)).astype(np.float32)
        mask = np.zeros((self.batch, self.seq), dtype=bool)
        if self.pad > 0:
            for b in range(self.batch):
                n_pad = int(rng.integers(0, round(self.pad * (self.seq - 1)) + 1))
                if n_pad:
                    mask[b, self.seq - n_pad :] = True
        if self.all_pad_row:
            mask[0, :] = True
        return np.ascontiguousarray(x), mask


@dataclass(frozen=True, eq=False)
class Given(Case):
    """A parity input given as arrays (``--calibration``'s real embeddings): ``make`` returns them as they are."""

    embeddings: np.ndarray | None = None  # (B, S, E) float32
    mask: np.ndarray | None = None  # (B, S) bool, true = padding

    def make(self, d_model: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.embeddings is None or self.embeddings.shape[-1] != d_model:
            raise ValueError(
                f"case {self.name!r} does not hold ({self.batch}, {self.seq}, {d_model}) embeddings"
            )
        mask = self.mask if self.mask is not None else np.zeros(self.embeddings.shape[:2], bool)
        return np.ascontiguousarray(self.embeddings, np.float32), np.ascontiguousarray(mask, bool)


def synthetic(cases: list[Case]) -> list[Case]:
    """The same cases judged as not representative (real inputs were given: synthetic ones only test the graph)."""
    return [dataclasses.replace(c, representative=False) for c in cases]


def default_cases() -> list[Case]:
    """20 random cases whose sizes differ from the export example (2, 5): seq 1, a long one, masked and not."""
    sizes = [
        (1, 1),
        (3, 1),
        (1, 2),
        (4, 3),
        (3, 4),
        (1, 7),
        (2, 8),
        (5, 9),
        (1, 16),
        (3, 16),
        (8, 12),
        (2, 33),
        (6, 31),
        (4, 64),
        (1, 100),
        (2, 128),
        (1, 256),
        (3, 47),
        (7, 20),
        (1, 512),
    ]
    cases = []
    for i, (b, s) in enumerate(sizes):
        pad = 0.5 if i % 2 and s > 1 else 0.0
        cases.append(Case(f"random b{b} s{s}{' masked' if pad else ''}", b, s, pad=pad))
    return cases


def adversarial_cases() -> list[Case]:
    """Inputs on which float32 itself is inexact or masking is extreme; each named in the report. None is
    representative: a lossy variant's quality is not judged on them, only its implementation."""
    return [
        Case("offset 1e2", 2, 16, offset=1e2, representative=False),
        Case("offset 1e3", 2, 16, offset=1e3, representative=False),
        Case("offset 1e4, spread 0.01", 2, 16, offset=1e4, scale=0.01, representative=False),
        Case("tiny spread (near eps)", 2, 16, scale=3e-3, representative=False),
        Case("constant rows (variance 0)", 2, 16, offset=0.5, constant=True, representative=False),
        Case("huge magnitude (1e4 scale)", 2, 16, scale=1e4, representative=False),
        Case("long sequence (2048)", 1, 2048, representative=False),
        Case("heavy padding (90%)", 4, 64, pad=0.9, representative=False),
        Case("row all padding", 3, 16, pad=0.5, all_pad_row=True, representative=False),
    ]
