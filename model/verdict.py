"""The parity verdict, torch-free: shared by the export gate (export.parity) and the server's check at load.

A comparison passes when the output is within the tolerance of torch fp32, or, where float32 itself is inexact,
when its error against the float64 oracle is at most ``oracle_factor`` times the larger of torch's own error and
a floor of FLOOR_ULPS float32 ulps of the output's scale. torch's own error can be small by luck on one CPU and
not on another (onnxruntime's LayerNorm and torch's accumulate differently); the floor keeps the verdict from
flipping with the CPU, and is still four orders below what one LayerNorm gamma off by 5% does.
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
ORACLE_FACTOR = 4.0  # ONNX may be this many times further from float64 than torch fp32 is (and still pass)


@dataclass(frozen=True)
class Tolerance:
    """Element-wise ``|onnx - torch| <= atol + rtol * |torch|`` (``atol`` None: no element-wise bound);
    ``rel_rms`` also bounds the relative RMS error ``||onnx - torch|| / ||torch||`` of each output.

    Row bounds, for lossy variants, on every row (one position's features) of each output: ``row_rel_rms``
    bounds ``||onnx - torch|| / ||torch||``, ``row_cosine`` is the least cosine similarity, and ``row_peak``
    bounds the worst element's error relative to the row's RMS.

    ``oracle_factor`` 0 turns the float64 rescue off (lossy variants are judged against torch fp32 only).
    """

    atol: float | None = FP32_ATOL
    rtol: float = FP32_RTOL
    oracle_factor: float = ORACLE_FACTOR
    rel_rms: float | None = None
    row_rel_rms: float | None = None
    row_cosine: float | None = None
    row_peak: float | None = None

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
        rule = "vs torch fp32: " + "; ".join(parts)
        if self.oracle_factor:
            rule += (
                f"; or error vs float64 <= {self.oracle_factor:g} x max(torch's own"
                + (", the variant's own arithmetic" if self.row_rel_rms is not None else "")
                + ", float32 floor)"
            )
        return rule


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
    scheme_vs_f64: float | None = None  # a lossy variant's scheme, computed exactly, against float64
    # How far over its allowance the output is, by the nearer of the rule's two ways to pass: <= 1 passes
    ratio: float = 0.0


def compare(
    output: str,
    onnx_out: np.ndarray,
    ref: np.ndarray,
    oracle: np.ndarray,
    tol: Tolerance,
    scheme: np.ndarray | None = None,
) -> Comparison:
    """Compare one output array of ONNX against torch fp32 and both against the float64 oracle.

    Passes within ``tol`` of torch, or when ONNX's error against the oracle is at most ``tol.oracle_factor``
    times the larger of torch's own and the float32 floor (see the module's docstring). ``scheme``: a lossy
    variant's own arithmetic computed exactly (export.int8.simulated); its error against the oracle joins that
    allowance, so an input on which the scheme itself is far from exact (attention so sharp that quantization
    moves its argmax) is judged against what the scheme can do.
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
    rows = row_errors(onnx_out, ref, diff)
    if tol.row_rel_rms is not None:
        within = (
            within
            and rows[0] <= tol.row_rel_rms
            and rows[1] >= (tol.row_cosine or -1.0)
            and rows[2] <= (tol.row_peak or math.inf)
        )
    torch_f64 = _max_err(ref, oracle)
    onnx_f64 = _max_err(onnx_out, oracle)
    # a scheme that overflows (fp16 on a 1e4-scale input) says nothing of how far the graph may be
    scheme_f64 = _max_err(scheme.astype(np.float64), oracle) if scheme is not None else None
    scheme_f64 = scheme_f64 if scheme_f64 is not None and math.isfinite(scheme_f64) else None
    floor = float32_floor(oracle)
    allowance = max(torch_f64, floor, scheme_f64 or 0.0)
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
        scheme_vs_f64=scheme_f64,
        ratio=ratio if finite else math.inf,
    )


def _ratio(
    tol: Tolerance, diff: np.ndarray, ref: np.ndarray, rel_rms: float, rows: tuple, rescue: float
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


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(a - b)
    return math.inf if np.isnan(d).any() else float(d.max())


def float32_floor(oracle: np.ndarray) -> float:
    """FLOOR_ULPS float32 ulps of the output's scale (its largest magnitude): what float32 cannot promise below."""
    scale = float(np.abs(oracle).max()) if oracle.size else 0.0
    return FLOOR_ULPS * float(np.finfo(np.float32).eps) * scale if np.isfinite(scale) else 0.0
