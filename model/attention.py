"""Attention forms of an artifact's graph, and the seq x seq memory each holds in one run. No torch.

The manifest records the form (``attention``); export spells it (export/attention.py); the service budgets runs
by it (service/batching/batcher.py, service/backend/engine.py). The score-tensor copies were measured as peak resident memory of
one [1, 4096, 768] run above the same run's flash-attention peak (docs/benchmarks.md, "Cost curve").
"""

from __future__ import annotations

FORMS = ("mha", "onnx", "decomposed")
# Whole (batch, heads, seq, seq) float32 tensors a run holds at once. mha holds one only when something is
# padded: with no key padding mask onnxruntime runs its flash-attention kernel, which holds none.
SCORE_COPIES = {"decomposed": 3, "onnx": 1, "mha": 1}


def score_elements(form: str, rows: int, heads: int, seq: int, padded: bool) -> int:
    """Elements of seq x seq tensors a run of ``rows`` x ``seq`` holds at once under ``form``."""
    if form == "mha" and not padded:
        return 0
    return SCORE_COPIES.get(form, SCORE_COPIES["decomposed"]) * rows * heads * seq * seq
