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
    """Element-wise ``|onnx - torch| <= atol + rtol * |torch|``; ``rel_rms`` also bounds the relative RMS error
    ``||onnx - torch|| / ||torch||`` of each output.

    ``oracle_factor`` 0 turns the float64 rescue off (lossy variants are judged against torch fp32 only).
    """

    atol: float = FP32_ATOL
    rtol: float = FP32_RTOL
    oracle_factor: float = ORACLE_FACTOR
    rel_rms: float | None = None


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


def compare(
    output: str, onnx_out: np.ndarray, ref: np.ndarray, oracle: np.ndarray, tol: Tolerance
) -> Comparison:
    """Compare one output array of ONNX against torch fp32 and both against the float64 oracle.

    Passes within ``tol`` of torch, or when ONNX's error against the oracle is at most ``tol.oracle_factor``
    times the larger of torch's own and the float32 floor (see the module's docstring).
    """
    onnx_out = onnx_out.astype(np.float64)
    ref = ref.astype(np.float64)
    finite = bool(np.isfinite(onnx_out).all() and np.isfinite(ref).all())
    diff = np.abs(onnx_out - ref)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only is the worst possible error
    excess = diff - (tol.atol + tol.rtol * np.abs(ref))
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    within = finite and bool((excess <= 0).all())
    ref_norm = float(np.sqrt(np.mean(ref**2)))
    rel_rms = float(np.sqrt(np.mean(diff**2)) / ref_norm) if ref_norm > 0 else float(diff.max())
    if tol.rel_rms is not None:
        within = within and rel_rms <= tol.rel_rms
    torch_f64 = _max_err(ref, oracle)
    onnx_f64 = _max_err(onnx_out, oracle)
    floor = float32_floor(oracle)
    passed = within or (finite and onnx_f64 <= tol.oracle_factor * max(torch_f64, floor))
    return Comparison(
        output=output,
        max_abs=float(diff.max()),
        max_rel=float((diff / np.maximum(np.abs(ref), tol.atol)).max()),
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
    )


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(a - b)
    return math.inf if np.isnan(d).any() else float(d.max())


def float32_floor(oracle: np.ndarray) -> float:
    """FLOOR_ULPS float32 ulps of the output's scale (its largest magnitude): what float32 cannot promise below."""
    scale = float(np.abs(oracle).max()) if oracle.size else 0.0
    return FLOOR_ULPS * float(np.finfo(np.float32).eps) * scale if np.isfinite(scale) else 0.0
