"""Golden data for the artifact: a few of the gate's own cases, with their inputs, torch fp32 and float64 outputs,
float32's spread and a lossy variant's scheme (model.golden), so a server's check at load applies the gate's rule
to the gate's cases."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from addnorm.export.cases import Case
from addnorm.export.parity import ParityReport
from addnorm.model.golden import save_golden

# Short and long, with and without padding; sizes unlike the export example (2, 5) and the parity cases.
GOLDEN_CASES = (
    Case("short", 1, 7),
    Case("padded", 3, 24, pad=0.5),
    Case("long", 1, 256),
)


GOLDEN_ROWS = 2  # sequences kept of each given case (the golden file stays small at 512 tokens)


def golden_cases(given: list[Case]) -> list[Case]:
    """The cases kept as golden data: the shortest, a middle and the longest given (real) inputs, two sequences
    of each, when there are any; else the synthetic GOLDEN_CASES. The gate runs them like every other case."""
    if not given:
        return list(GOLDEN_CASES)
    picked = {id(c): c for c in (given[0], given[len(given) // 2], given[-1])}.values()
    return [
        dataclasses.replace(
            c,
            name=f"golden {c.name.split(' (')[0]} ({min(c.batch, GOLDEN_ROWS)} x {c.seq})",
            batch=min(c.batch, GOLDEN_ROWS),
            embeddings=c.embeddings[:GOLDEN_ROWS],
            mask=c.mask[:GOLDEN_ROWS],
        )
        for c in picked
    ]


def write_golden(report: ParityReport, path: str | Path) -> None:
    """Save the cases the gate kept (``run_parity(keep=...)``) to ``path``."""
    if not report.kept:
        raise ValueError("the parity report kept no case for the golden data")
    save_golden(path, report.kept)
