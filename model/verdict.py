"""The parity verdict, torch-free: shared by the export gate (export.parity), the server's check at load
(model.golden) and live parity.

fp32 graphs: a comparison passes when the output is within the tolerance of torch fp32, or, where float32 itself
is inexact, when its error against the float64 oracle is at most ``oracle_factor`` times what float32 can do on
that input: the largest error against float64 of several float32 evaluations of it (torch's, the numpy float32
reference's, torch's on the input moved by one ulp: the caller's ``spread``), and a floor of FLOOR_ULPS float32
ulps of the output's scale. One float32 sample (torch's own error alone) is luck: on a real 6-layer checkpoint at
512 tokens torch was 5e-5 from float64 and the numpy float32 reference 1.4e-4, and an onnxruntime graph at 2.5e-4
was refused as if broken (docs/parity.md, "The float32 yardstick").

Lossy graphs (fp16, int8) get two verdicts, both required:
- implementation: the graph computes its scheme (``scheme``: the variant's arithmetic computed exactly); its
  worst row's distance to the scheme is at most IMPLEMENTATION_FACTOR x what the scheme's arithmetic does on that
  input: the larger of the scheme's own worst row against fp32 and of its evaluation on the input moved by one
  ulp of the precision it rounds its input to (the caller's ``spread``). One sample is luck here too: on the real
  checkpoint's synthetic case fp16's scheme was 3.2e-3 from fp32, and 5e-3 to 2.2e-2 on inputs one ulp away;
- quality: the graph is close enough to torch fp32 (the tolerance's per-row bounds), judged on representative
  inputs only (``quality=False`` for an adversarial input, where only the implementation is judged). No rescue
  applies to quality: a scheme far from fp32 fails, however faithfully the graph computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FP32_ATOL = 1e-5
FP32_RTOL = 1e-4
FLOOR_ULPS = (
    16  # measured: onnxruntime's worst adversarial error here is 1.5e-5 = 3.3 ulps x 4 of a scale of 3.9
)
ORACLE_FACTOR = 4.0  # ONNX may be this many times further from float64 than float32's spread (and still pass)
# A lossy graph's worst row may be this many times further from its scheme than the scheme is from fp32 (the
# larger of its two evaluations): two roundings of one scheme differ by about sqrt(2) x one (a rounding flip
# early in a deep stack moves every later one; onnxruntime's fp16 kernels round at other points than torch half);
# a 5% LayerNorm gamma is far beyond it wherever the scheme is closer to fp32 than 1.7% (fp16: 27x on the real
# checkpoint).
IMPLEMENTATION_FACTOR = 3.0
# The implementation bound never goes below this relative RMS: a scheme equal to fp32 on some input (an all-zero
# row) leaves room for float32's own rounding.
IMPLEMENTATION_FLOOR = 1e-4


@dataclass(frozen=True)
class Tolerance:
    """Element-wise ``|onnx - torch| <= atol + rtol * |torch|`` (``atol`` None: no element-wise bound);
    ``rel_rms`` also bounds the relative RMS error ``||onnx - torch|| / ||torch||`` of each output.

    Row bounds, for lossy variants, on every row (one position's features) of each output: ``row_rel_rms``
    bounds ``||onnx - torch|| / ||torch||``, ``row_cosine`` is the least cosine similarity, and ``row_peak``
    bounds the worst element's error relative to the row's RMS.

    ``sentence_cosine``, for lossy variants, is the least cosine of a sentence embedding (a sequence's rows
    averaged over its real tokens, sentence-transformers' mean pooling; a pooled output's rows themselves): what
    a user of a sentence-embedding model compares, and on a trained model the finer measure. A 6-layer BERT's
    token rows spread around it: int8 at 0.9995 per sentence has token rows 6% from fp32, the first int8 scheme's
    8-11% at 0.9985 (docs/parity.md).

    ``oracle_factor`` 0 turns the float64 rescue off (lossy variants are judged against torch fp32 only).
    """

    atol: float | None = FP32_ATOL
    rtol: float = FP32_RTOL
    oracle_factor: float = ORACLE_FACTOR
    rel_rms: float | None = None
    row_rel_rms: float | None = None
    row_cosine: float | None = None
    row_peak: float | None = None
    sentence_cosine: float | None = None

    def describe(self) -> str:
        """The rule in one line, as the report and the load-time check print it."""
        parts = (
            [f"|onnx - torch| <= atol + rtol x |torch| per element (atol {self.atol:g}, rtol {self.rtol:g})"]
            if self.atol is not None
            else []
        )
        if self.rel_rms is not None:
            parts.append(f"relative RMS <= {self.rel_rms:g}")
        if self.row_rel_rms is not None:
            parts.append(
                f"per row: relative RMS <= {self.row_rel_rms:g}, cosine >= {self.row_cosine:g}, "
                f"worst element <= {self.row_peak:g} x the row's RMS"
            )
        if self.sentence_cosine is not None:
            parts.append(f"per sentence (mean over its real tokens): cosine >= {self.sentence_cosine:g}")
        if self.lossy:
            return (
                "quality (representative inputs) vs torch fp32: "
                + "; ".join(parts)
                + f"; implementation: worst row relative RMS vs the scheme's exact arithmetic <= "
                f"{IMPLEMENTATION_FACTOR:g} x the scheme's own vs fp32 (the larger of it on the input and on the "
                "input moved by one ulp)"
            )
        rule = "vs torch fp32: " + "; ".join(parts)
        if self.oracle_factor:
            rule += (
                f"; or error vs float64 <= {self.oracle_factor:g} x max(float32's spread on the input, "
                "float32 floor)"
            )
        return rule

    @property
    def lossy(self) -> bool:
        """Judged per row, in two verdicts (quality and implementation), with no float64 rescue."""
        return self.row_rel_rms is not None


@dataclass
class Comparison:
    """How one output of one case compares: ONNX vs torch fp32, and both vs the float64 oracle."""

    output: str
    max_abs: float
    max_rel: float
    mean_abs: float
    p99_abs: float
    rel_rms: float
    torch_vs_f64: float
    onnx_vs_f64: float
    within_tolerance: bool
    passed: bool
    worst_index: list[int]
    worst_onnx: float
    worst_torch: float
    finite: bool
    float32_floor: float = 0.0  # FLOOR_ULPS ulps of the oracle output's scale
    row_rel_rms: float = 0.0  # the worst row's ||onnx - torch|| / ||torch||
    row_cosine: float = 1.0  # the least cosine similarity of a row
    row_peak: float = 0.0  # the worst element's error over its row's RMS
    sentence_cosine: float = 1.0  # the least cosine of a sentence embedding (Tolerance.sentence_cosine)
    scheme_vs_f64: float | None = None  # a lossy variant's scheme, computed exactly, against float64
    # float32's spread on this input: the largest error vs float64 of its float32 runs (torch's alone where the
    # gate did not need the others: export.parity measures them only where torch's error does not pass a case)
    spread: float = 0.0
    # lossy variants: the two verdicts (None: not judged here) and their measures
    quality: bool | None = None  # the row bounds vs torch fp32 (representative inputs only)
    implementation: bool | None = None  # the graph computes its scheme
    graph_vs_scheme: float | None = None  # the worst row's relative RMS of the graph against its scheme
    # the worst row's relative RMS of the scheme against torch fp32: the larger of its evaluation on the input and,
    # where the gate measured it (export.parity.scheme_spread), on the input moved by one ulp
    scheme_vs_fp32: float | None = None
    # How far over its allowance the output is, by the nearer of the rule's two ways to pass: <= 1 passes
    ratio: float = 0.0


def compare(
    output: str,
    onnx_out: np.ndarray,
    ref: np.ndarray,
    oracle: np.ndarray,
    tol: Tolerance,
    scheme: np.ndarray | None = None,
    spread: float | None = None,
    quality: bool = True,
    real: np.ndarray | None = None,
    sequence_axis: int = 1,
    scheme_ref: np.ndarray | None = None,
) -> Comparison:
    """Compare one output array of ONNX against torch fp32 and both against the float64 oracle.

    fp32 (see the module's docstring): passes within ``tol`` of torch, or when ONNX's error against the oracle is
    at most ``tol.oracle_factor`` times the largest of torch's own, ``spread`` (the other float32 evaluations'
    largest error vs float64) and the float32 floor.

    Lossy (``tol.lossy``): passes when the graph computes ``scheme`` (the variant's arithmetic computed exactly;
    ``spread``: the worst row vs fp32 of its other evaluation, ``worst_row``) and, with ``quality``, when it is
    within the row bounds of torch fp32. Without ``scheme`` the implementation
    is not judged. ``real``: which rows (positions: the output's leading dims) hold real tokens; a lossy
    variant's two verdicts read only those (a padded position's answer is read by no one). ``sequence_axis``: a
    positional output's sequence axis (0 for a sequence-first graph's), over which sentences are pooled.
    ``scheme_ref``: what the scheme's own distance is measured against when it is not ``ref`` (a step judged
    given the graph's previous step: torch fp32 given it too).
    """
    onnx_out = onnx_out.astype(np.float64)
    ref = ref.astype(np.float64)
    finite = bool(np.isfinite(onnx_out).all() and np.isfinite(ref).all())
    diff = np.abs(onnx_out - ref)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only is the worst possible error
    excess = diff - (tol.atol + tol.rtol * np.abs(ref)) if tol.atol is not None else diff
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    within = finite and (tol.atol is None or bool((excess <= 0).all()))
    ref_norm = float(np.sqrt(np.mean(ref**2)))
    rel_rms = float(np.sqrt(np.mean(diff**2)) / ref_norm) if ref_norm > 0 else float(diff.max())
    if tol.rel_rms is not None:
        within = within and rel_rms <= tol.rel_rms
    # a lossy variant's rows are read over real tokens only (every row for fp32's report)
    sel = _real_rows(real, onnx_out.shape[:-1]) if tol.lossy else None
    out_rows, ref_rows, diff_rows = (
        (onnx_out, ref, diff) if sel is None else (onnx_out[sel], ref[sel], diff[sel])
    )
    rows = row_errors(out_rows, ref_rows, diff_rows)
    if tol.row_rel_rms is not None:
        within = within and _rows_within(tol, rows)
    sentences = 1.0
    if tol.sentence_cosine is not None and quality:  # a quality measure: read only where quality is judged
        sentences = sentence_cosine(onnx_out, ref, real, sequence_axis)
        within = within and sentences >= tol.sentence_cosine
    torch_f64 = _max_err(ref, oracle)
    onnx_f64 = _max_err(onnx_out, oracle)
    # (a step judged on the graph's previous step has no float64 run on that input)
    scheme_f64 = (
        _max_err(scheme.astype(np.float64), oracle) if scheme is not None and scheme_ref is None else None
    )
    scheme_f64 = scheme_f64 if scheme_f64 is not None and math.isfinite(scheme_f64) else None
    floor = float32_floor(oracle)
    lossy: dict = {}
    if tol.lossy:
        scheme_rows, own_ref = (
            (a if a is None or sel is None else a[sel])
            for a in (scheme, ref if scheme_ref is None else scheme_ref)
        )
        scheme_spread = spread if spread is not None and math.isfinite(spread) else 0.0
        lossy = _lossy_verdicts(
            out_rows,
            own_ref.astype(np.float64),
            scheme_rows,
            finite,
            within if quality else None,
            scheme_spread,
        )
        spread = torch_f64
        passed = finite and lossy["implementation"] is not False and lossy["quality"] is not False
        ratio = max(
            lossy.pop("ratio"), _ratio(tol, diff, ref, rel_rms, rows, math.inf, sentences) if quality else 0.0
        )
    else:
        spread = max(torch_f64, spread or 0.0)
        allowance = max(spread, floor)
        passed = within or (finite and onnx_f64 <= tol.oracle_factor * allowance)
        ratio = _ratio(tol, diff, ref, rel_rms, rows, onnx_f64 / max(tol.oracle_factor * allowance, 1e-300))
    return Comparison(
        output=output,
        max_abs=float(diff.max()),
        max_rel=float((diff / np.maximum(np.abs(ref), tol.atol or FP32_ATOL)).max()),
        mean_abs=float(diff.mean()),
        p99_abs=float(np.percentile(diff, 99, method="higher")),
        rel_rms=rel_rms,
        torch_vs_f64=torch_f64,
        onnx_vs_f64=onnx_f64,
        within_tolerance=within,
        passed=passed,
        worst_index=[int(i) for i in worst],
        worst_onnx=float(onnx_out[worst]),
        worst_torch=float(ref[worst]),
        finite=finite,
        float32_floor=floor,
        row_rel_rms=rows[0],
        row_cosine=rows[1],
        row_peak=rows[2],
        sentence_cosine=sentences,
        scheme_vs_f64=scheme_f64,
        spread=spread,
        ratio=ratio if finite else math.inf,
        **lossy,
    )


def _real_rows(real: np.ndarray | None, shape: tuple) -> np.ndarray | None:
    """The boolean selector of real rows, or None where every row is real (or none is: all are then read)."""
    if real is None:
        return None
    real = np.broadcast_to(np.asarray(real, bool), shape)
    return real if real.any() and not real.all() else None


def worst_row(out: np.ndarray, ref: np.ndarray, real: np.ndarray | None = None) -> float:
    """The worst row's relative RMS of ``out`` against ``ref``, over the rows ``real`` selects (as ``compare``
    reads a lossy output's rows)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    sel = _real_rows(real, out.shape[:-1])
    out, ref = (out, ref) if sel is None else (out[sel], ref[sel])
    return row_errors(out, ref, np.abs(out - ref))[0]


def _rows_within(tol: Tolerance, rows: tuple[float, float, float]) -> bool:
    return (
        rows[0] <= tol.row_rel_rms
        and rows[1] >= (tol.row_cosine or -1.0)
        and rows[2] <= (tol.row_peak or math.inf)
    )


def _lossy_verdicts(
    out: np.ndarray,
    ref: np.ndarray,
    scheme: np.ndarray | None,
    finite: bool,
    quality: bool | None,
    spread: float = 0.0,
) -> dict:
    """A lossy graph's ``implementation`` verdict (``quality``: as judged by the row bounds, None: not judged on
    this input): the graph's worst row against its scheme, over the scheme's worst row against fp32 (``ref``; the
    larger of this evaluation's and ``spread``, its other one's)."""
    result: dict = {"quality": quality, "implementation": None, "ratio": 0.0}
    if scheme is None:
        return result
    scheme = scheme.astype(np.float64)
    if not np.isfinite(scheme).all():  # a scheme that overflows (fp16 on a 1e4-scale input) says nothing
        return result
    own = max(row_errors(scheme, ref, np.abs(scheme - ref))[0], spread)
    graph = row_errors(out, scheme, np.abs(out - scheme))[0] if finite else math.inf
    bound = max(IMPLEMENTATION_FACTOR * own, IMPLEMENTATION_FLOOR)
    result.update(
        implementation=graph <= bound, graph_vs_scheme=graph, scheme_vs_fp32=own, ratio=graph / bound
    )
    return result


def _ratio(
    tol: Tolerance,
    diff: np.ndarray,
    ref: np.ndarray,
    rel_rms: float,
    rows: tuple,
    rescue: float,
    sentences: float = 1.0,
) -> float:
    """Each bound's measure over its limit, the worst of them for the tolerance, then the better of that and the
    float64 rescue (``rescue``: the error vs float64 over its allowance)."""
    parts = []
    if tol.atol is not None:
        parts.append(float((diff / (tol.atol + tol.rtol * np.abs(ref))).max()) if diff.size else 0.0)
    if tol.rel_rms is not None:
        parts.append(rel_rms / tol.rel_rms)
    if tol.row_rel_rms is not None:
        parts.append(rows[0] / tol.row_rel_rms)
        parts.append((1 - rows[1]) / max(1 - (tol.row_cosine or -1.0), 1e-300))
        parts.append(rows[2] / (tol.row_peak or math.inf))
    if tol.sentence_cosine is not None:
        parts.append((1 - sentences) / max(1 - tol.sentence_cosine, 1e-300))
    within = max(parts) if parts else math.inf
    return min(within, rescue if tol.oracle_factor else math.inf)


# Rows whose reference RMS is below this (all-zero rows) are measured against it instead of their own.
ROW_SCALE_FLOOR = 1e-6


def row_errors(out: np.ndarray, ref: np.ndarray, diff: np.ndarray) -> tuple[float, float, float]:
    """(worst relative RMS, least cosine, worst element over its row's RMS) over the rows of the last axis."""
    if not out.size or not np.isfinite(out).all():
        return math.inf, -1.0, math.inf
    scale = np.maximum(np.sqrt(np.mean(ref**2, axis=-1)), ROW_SCALE_FLOOR)
    rel = np.sqrt(np.mean(diff**2, axis=-1)) / scale
    norms = np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1)
    cos = np.where(norms > 0, (out * ref).sum(-1) / np.maximum(norms, 1e-300), 1.0)
    peak = diff.max(axis=-1) / scale
    return float(rel.max()), float(cos.min()), float(peak.max())


def sentence_cosine(
    out: np.ndarray, ref: np.ndarray, real: np.ndarray | None = None, sequence_axis: int = 1
) -> float:
    """The least cosine between ``out``'s and ``ref``'s sentence embeddings: a positional output (3-D) averaged
    over each sequence's real tokens (``real``, the output's leading dims; every position without it), a pooled
    output's (2-D) rows as they are."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return -1.0
    if out.ndim == 3:
        weight = (
            np.ones(out.shape[:-1]) if real is None else np.broadcast_to(real, out.shape[:-1]).astype(float)
        )
        count = np.maximum(weight.sum(axis=sequence_axis), 1.0)[..., None]
        out, ref = ((a * weight[..., None]).sum(axis=sequence_axis) / count for a in (out, ref))
    norms = np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1)
    cos = np.where(norms > 0, (out * ref).sum(-1) / np.maximum(norms, 1e-300), 1.0)
    return float(cos.min()) if cos.size else 1.0


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(a - b)
    return math.inf if np.isnan(d).any() else float(d.max())


def float32_floor(oracle: np.ndarray) -> float:
    """FLOOR_ULPS float32 ulps of the output's scale (its largest magnitude): what float32 cannot promise below."""
    scale = float(np.abs(oracle).max()) if oracle.size else 0.0
    return FLOOR_ULPS * float(np.finfo(np.float32).eps) * scale if np.isfinite(scale) else 0.0
