"""Attention forms of an artifact's graph, and the seq x seq memory each holds in one run. No torch.

The manifest records the form (``attention``); export spells it (export/attention.py); the service budgets runs
by it (service/batching/batcher.py, service/backend/engine.py). The score-tensor copies were measured as peak resident memory of
one [1, 4096, 768] run above the same run's flash-attention peak (docs/benchmarks.md, "The cost curve").
"""

from __future__ import annotations

FORMS = ("mha", "onnx", "decomposed")
# Whole (batch, heads, seq, seq) float32 tensors a run holds at once. mha holds one only when something is
# padded: with no key padding mask onnxruntime runs its flash-attention kernel, which holds none.
# An mha graph with MPNet's relative position bias always masks ("mha-biased"): no flash kernel.
# An mha graph's local layers (a window of keys: ModernBERT's) hold one up to BANDED_FROM positions, where their
# window is a bias on one masked MultiHeadAttention, and none past it, where it runs in blocks of the window
# (export/attention.py; the threshold measured in docs/benchmarks.md, "ModernBERT at real lengths").
SCORE_COPIES = {"decomposed": 3, "onnx": 1, "mha": 1, "mha-biased": 1, "mha-windowed": 1}
BANDED_FROM = 512


def held_form(form: str, relative: bool, windowed: bool = False) -> str:
    """The form whose seq x seq tensors a graph of ``form`` holds (``relative``: with a relative position bias in
    every layer; ``windowed``: with local layers)."""
    if form != "mha":
        return form
    return "mha-biased" if relative else "mha-windowed" if windowed else form


def score_elements(form: str, rows: int, heads: int, seq: int, padded: bool) -> int:
    """Elements of seq x seq tensors a run of ``rows`` x ``seq`` holds at once under ``form`` (``held_form``)."""
    if not padded and (form == "mha" or (form == "mha-windowed" and seq > BANDED_FROM)):
        return 0
    return SCORE_COPIES.get(form, SCORE_COPIES["decomposed"]) * rows * heads * seq * seq


# MPNet's relative position bias (transformers' MPNetEncoder.relative_position_bucket, which always computes 32
# buckets up to a distance of 128): each (query, key) pair's distance key - query falls in a bucket, and each head
# adds its learned value for that bucket to the pair's score, in every layer.
RELATIVE_BUCKETS = 32
RELATIVE_MAX_DISTANCE = 128


def relative_buckets(buckets: int = RELATIVE_BUCKETS, max_distance: int = RELATIVE_MAX_DISTANCE) -> list[int]:
    """The bucket of each distance key - query in [-max_distance, max_distance] (index 0 is -max_distance); every
    distance beyond shares its end's bucket. Half the buckets per direction; the first half of those one distance
    each, the rest spaced logarithmically up to ``max_distance``. transformers computes the logarithm in float32;
    this is the same bucket, decided in integers (checked against transformers for every distance in the tests), so
    the torch module and the numpy oracle read one table and no CPU's logarithm can move a boundary."""
    half = buckets // 2
    exact = half // 2
    steps = half - exact

    def bucket(distance: int) -> int:
        n = -distance  # transformers' sign: a key before its query is the positive side
        base = half if n < 0 else 0
        n = abs(n)
        if n < exact:
            return base + n
        # the largest k with (n / exact) ** steps >= (max_distance / exact) ** k: floor(steps * log(n/exact) /
        # log(max_distance/exact)), exactly
        k = 0
        while k < steps and n**steps * exact ** (k + 1) >= max_distance ** (k + 1) * exact**steps:
            k += 1
        return base + min(exact + k, half - 1)

    return [bucket(d) for d in range(-max_distance, max_distance + 1)]
