"""The arithmetic of each graph variant, in numpy (no torch), for ``model.reference``: exact (fp32 and fused
graphs; the float64 oracle), int8 (export/int8.py's scheme: 7-bit weights per column, activations per row) and
fp16 (every result stored in half precision). The export gate computes a lossy variant's scheme with torch
(export/variants.py); the server has no torch, and live parity (service/live_parity.py) needs the same allowance,
so the numbers of the int8 scheme are defined here once and export/int8.py writes the graph from them.
"""

from __future__ import annotations

import numpy as np

WEIGHT_MAX = 63  # 7-bit symmetric weights: 2 * 255 * 63 = 32130 fits VPMADDUBSW's int16 pair sums
HALF = 127.0  # activations: round((x - c) / p * 127) in [-127, 127], stored + 128 as uint8
ZERO_POINT = 128
TINY = 1e-30  # a constant row has p = 0: its q is all zero point and the mean term carries it exactly


def quantize_weight(w: np.ndarray, levels: int = WEIGHT_MAX) -> tuple[np.ndarray, np.ndarray]:
    """(E, N) float -> (int8 (E, N) in [-levels, levels], per-column scale (N,) float32)."""
    peak = np.abs(w).max(axis=0)
    scale = np.where(peak > 0, peak / levels, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -levels, levels).astype(np.int8)
    return q, scale


class Exact:
    """Every operation exact in the arrays' dtype: float64 for the oracle, float32 for a float32 run."""

    name = "exact"

    def cast(self, x: np.ndarray) -> np.ndarray:
        """What storing an intermediate result does to it."""
        return x

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """``x @ weight.T + bias`` (torch's Linear layout: weight is (N, E))."""
        return x @ weight.T + bias


class Int8(Exact):
    """export/int8.py's scheme, computed exactly in the arrays' dtype: each row of ``x`` quantized to 8 bits around
    its own mean, the weight to 7 bits per output column, the mean term exact."""

    name = "int8"

    def __init__(self) -> None:
        self._weights: dict[
            int, tuple[np.ndarray, np.ndarray, np.ndarray]
        ] = {}  # id -> (weight, dequantized, colsum)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        kept = self._weights.get(id(weight))
        if kept is None or kept[0] is not weight:
            wq, scale = quantize_weight(weight.T.astype(np.float64))  # the graph's (E, N)
            deq = (wq.astype(np.float64) * scale.astype(np.float64)).astype(x.dtype)
            kept = self._weights[id(weight)] = (weight, deq, weight.sum(axis=1).astype(x.dtype))
        _, deq, colsum = kept
        mean = x.mean(axis=-1, keepdims=True)
        dev = x - mean
        peak = np.maximum(np.abs(dev).max(axis=-1, keepdims=True), TINY)
        q = np.clip(np.rint(dev * (HALF / peak)), -HALF, HALF)  # round half to even, as QuantizeLinear
        return (q @ deq) * (peak / HALF) + mean * colsum + bias


class Half(Exact):
    """fp16: float32 arithmetic whose every stored result is rounded to half precision (what onnxruntime's and
    torch's CPU half kernels do: accumulate in float32, store float16). Give it float32 arrays; weights are rounded
    to half where they are used."""

    name = "fp16"

    def cast(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).astype(np.float32)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        return self.cast(x @ self.cast(weight).T + self.cast(bias))


def for_variant(variant: str) -> Exact | None:
    """The arithmetic of a variant by its manifest name; None for a variant this module does not know."""
    return {"fp32": Exact, "fused": Exact, "int8": Int8, "fp16": Half}.get(variant, lambda: None)()
