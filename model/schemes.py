"""The arithmetic of each graph variant, in numpy (no torch), for ``model.reference``: exact (fp32 and fused
graphs; the float64 oracle), int8 (export/int8.py's scheme: 7-bit weights per column, activations per row, a few
float channels) and fp16 (every result stored in half precision). The export gate computes a lossy variant's
scheme with torch (export/variants.py); the server has no torch, and live parity (service/live_parity.py) needs
the same allowance, so the numbers of the int8 scheme are defined here once and export/int8.py writes the graph
from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

WEIGHT_MAX = 63  # 7-bit symmetric weights: 2 * 255 * 63 = 32130 fits VPMADDUBSW's int16 pair sums
HALF = 127.0  # activations: round((x - c) / p * 127) in [-127, 127], stored + 128 as uint8
ZERO_POINT = 128
TINY = 1e-30  # a constant row has p = 0: its q is all zero point and the mean term carries it exactly
# int8: the input channels of each weight product with the largest peaks on representative inputs (a trained
# BERT's outlier dimensions) are multiplied in float; the manifest's scheme names them by weight (docs/parity.md)
FLOAT_CHANNELS = 8
FLOAT_CHANNELS_KEY = "float_channels"


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
    its own mean, the weight to 7 bits per output column, the mean term exact; the input channels named in
    ``float_channels`` (by weight name, as the artifact's manifest records them under ``scheme``) leave the
    integer product and are multiplied in float. ``weights``: the arrays ``forward`` is given, to know each
    weight's name (needed only with ``float_channels``)."""

    name = "int8"

    def __init__(
        self,
        float_channels: Mapping[str, Sequence[int]] | None = None,
        weights: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self._channels = {k: np.asarray(v, np.int64) for k, v in (float_channels or {}).items()}
        if self._channels and weights is None:
            raise ValueError("Int8 with float channels needs the weights, to name each weight it is given")
        self._names = {id(w): k for k, w in (weights or {}).items()}
        # id -> (weight, dequantized rest, float rows, rest's column sums, channels)
        self._weights: dict[int, tuple[np.ndarray, ...]] = {}

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        kept = self._weights.get(id(weight))
        if kept is None or kept[0] is not weight:
            idx = self._channels.get(self._names.get(id(weight), ""), np.zeros(0, np.int64))
            rest = weight.T.astype(np.float64)  # the graph's (E, N)
            rest[idx] = 0.0
            wq, scale = quantize_weight(rest)
            deq = (wq.astype(np.float64) * scale.astype(np.float64)).astype(x.dtype)
            rows = weight.T[idx].astype(x.dtype)
            kept = self._weights[id(weight)] = (weight, deq, rows, rest.sum(axis=0).astype(x.dtype), idx)
        _, deq, rows, colsum, idx = kept
        mean = x.mean(axis=-1, keepdims=True)
        dev = x - mean
        dev[..., idx] = 0.0
        peak = np.maximum(np.abs(dev).max(axis=-1, keepdims=True), TINY)
        q = np.clip(np.rint(dev * (HALF / peak)), -HALF, HALF)  # round half to even, as QuantizeLinear
        return (q @ deq) * (peak / HALF) + (mean * colsum + x[..., idx] @ rows) + bias


class Half(Exact):
    """fp16: float32 arithmetic whose every stored result is rounded to half precision (what onnxruntime's and
    torch's CPU half kernels do: accumulate in float32, store float16). Give it float32 arrays; weights are rounded
    to half where they are used."""

    name = "fp16"

    def cast(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).astype(np.float32)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        return self.cast(x @ self.cast(weight).T + self.cast(bias))


def for_variant(
    variant: str, plan: Mapping | None = None, weights: Mapping[str, np.ndarray] | None = None
) -> Exact | None:
    """The arithmetic of a variant by its manifest name and scheme (``plan``: the manifest's ``scheme``, int8's
    float channels); None for a variant this module does not know. ``weights``: the arrays it will be given."""
    if variant == "int8":
        return Int8((plan or {}).get(FLOAT_CHANNELS_KEY), weights)
    return {"fp32": Exact, "fused": Exact, "fp16": Half}.get(variant, lambda: None)()


def float_channel_count(width: int) -> int:
    """How many of a weight product's ``width`` input channels int8 keeps in float."""
    return min(FLOAT_CHANNELS, width // 16)
