"""The arithmetic of each graph variant, in numpy (no torch), for ``model.reference``: exact (fp32 and fused
graphs; the float64 oracle), int8 (export/int8.py's scheme: 8-bit weights per column, activations per row, a few
float channels; ``Form``) and fp16 (every result stored in half precision). The export gate computes a lossy variant's
scheme with torch (export/variants.py); the server has no torch, and live parity (service/models/live_parity.py) needs
the same allowance, so the numbers of the int8 scheme are defined here once and export/int8.py writes the graph
from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

WEIGHT_MAX = 63  # "7bit" weights: 2 * 255 * 63 = 32130 fits VPMADDUBSW's int16 pair sums
HALF = 127.0  # "mean" rows: round((x - c) / p * 127) in [-127, 127], stored + 128 as uint8
ZERO_POINT = 128
# "minmax" rows: a step of 1/254 of the row's span and an integer zero point, so its least and largest values
# land on levels 0..255 without saturating (rounding the zero point moves them by up to half a level)
STEPS = 254.0
TINY = 1e-30  # a constant row has no span: its q is all zero and the exact term carries it
# int8: the input channels of each weight product with the largest peaks on representative inputs (a trained
# BERT's outlier dimensions) are multiplied in float; the manifest's scheme names them by weight (docs/parity.md)
FLOAT_CHANNELS = 8
FLOAT_CHANNELS_KEY = "float_channels"
# "pairs8" weights: VPMADDUBSW (u8 x s8 on CPUs without VNNI) adds the products of input channels 2k and 2k + 1
# in int16, which holds 255 x 128 = 32640 but not 255 x 129. With each such pair's same-sign weights summing to
# at most PAIR_BOUND levels, every x86 kind computes the exact int32 sums with weights of up to 127 levels.
PAIR_BOUND = 128
WEIGHT_LEVELS_8 = 127
WEIGHTS_KEY = "weights"
ROWS_KEY = "rows"


@dataclass(frozen=True)
class Form:
    """How an int8 graph quantizes, as the manifest's ``scheme`` records it (keys ``weights`` and ``rows``).

    ``weights``: "pairs8", 8 bits per output column with every VPMADDUBSW pair bounded (``quantize_weight_pairs``),
    or "7bit", symmetric in [-63, 63]. ``rows``: each activation row's 8 bits span "minmax", the row's least to
    its largest distance from its mean (254 steps and an integer zero point), or "mean", +-its largest distance
    from its mean (255 levels); the mean is carried exactly either way. A scheme that names neither is the first
    int8 artifacts' form, ``LEGACY`` (7bit, mean); new exports take the default (pairs8, minmax)."""

    weights: str = "pairs8"
    rows: str = "minmax"

    @classmethod
    def of(cls, plan: Mapping | None) -> Form:
        """The form a manifest's ``scheme`` records."""
        plan = plan or {}
        return cls(plan.get(WEIGHTS_KEY, LEGACY.weights), plan.get(ROWS_KEY, LEGACY.rows))

    def __post_init__(self) -> None:
        if self.weights not in ("pairs8", "7bit") or self.rows not in ("minmax", "mean"):
            raise ValueError(f"unknown int8 form: weights {self.weights!r}, rows {self.rows!r}")

    def to_plan(self) -> dict[str, str]:
        return {WEIGHTS_KEY: self.weights, ROWS_KEY: self.rows}

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(E, N) float -> (int8 (E, N), per-column scale (N,) float32) in this form's weights."""
        return quantize_weight_pairs(w) if self.weights == "pairs8" else quantize_weight(w)

    def rows_of(self, x: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """Activation rows ``x`` -> (levels, step, base, centre), per row: outside the float channels ``idx``
        (whose levels are 0), ``x ~ centre + base + levels * step``; the levels are the integers the product
        takes, ``centre`` the mean the float weights carry exactly (so a row's offset costs none of its bits, and
        the weights' rounding meets only each value's distance from it), ``base`` what the quantized weights
        carry. Computed in ``x``'s dtype, as the graph computes them (export/int8.py)."""
        if self.rows == "mean":  # the mean of every channel, the float ones too
            centre = x.mean(axis=-1, keepdims=True)
            dev = x - centre
            dev[..., idx] = 0.0
            reach = np.maximum(np.abs(dev).max(axis=-1, keepdims=True), TINY)
            levels = np.clip(np.rint(dev * (HALF / reach)), -HALF, HALF)
            return levels, reach / HALF, np.zeros_like(centre), centre
        keep = np.ones(x.shape[-1], bool)
        keep[idx] = False
        centre = x[..., keep].mean(axis=-1, keepdims=True)
        dev = x - centre
        dev[..., idx] = 0.0
        lo = dev.min(axis=-1, keepdims=True)
        step = np.maximum(dev.max(axis=-1, keepdims=True) - lo, TINY) / STEPS
        zero = np.clip(np.rint(-(lo / step)), 0.0, 255.0)  # QuantizeLinear: round half to even, saturate
        levels = np.clip(np.rint(dev / step) + zero, 0.0, 255.0) - ZERO_POINT  # taken around level 128
        levels[..., idx] = 0.0  # their weights are zero: the graph's level there counts for nothing
        return levels, step, (ZERO_POINT - zero) * step, centre


LEGACY = Form("7bit", "mean")
DEFAULT_FORM = Form()


def quantize_weight(w: np.ndarray, levels: int = WEIGHT_MAX) -> tuple[np.ndarray, np.ndarray]:
    """(E, N) float -> (int8 (E, N) in [-levels, levels], per-column scale (N,) float32)."""
    peak = np.abs(w).max(axis=0)
    scale = np.where(peak > 0, peak / levels, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -levels, levels).astype(np.int8)
    return q, scale


def quantize_weight_pairs(w: np.ndarray, bound: int = PAIR_BOUND) -> tuple[np.ndarray, np.ndarray]:
    """(E, N) float -> (int8 (E, N) in [-127, 127], per-column scale (N,) float32) in which rows 2k and 2k + 1 hold
    same-sign values summing to at most ``bound`` in every column. A column's scale is the larger of its peak over
    127 and its largest same-sign pair sum over ``bound``; where rounding carries a pair one level over, the member
    rounded further from zero goes back one level (its error stays within half a level)."""
    rows = w.shape[0]
    w = np.asarray(w, np.float64)
    if rows % 2:  # an odd width: the last channel's partner is a zero (MLAS pads K with zeros too)
        w = np.concatenate([w, np.zeros((1, w.shape[1]))])
    pos, neg = np.maximum(w, 0.0), np.maximum(-w, 0.0)
    pairs = np.maximum((pos[0::2] + pos[1::2]).max(axis=0), (neg[0::2] + neg[1::2]).max(axis=0))
    need = np.maximum(np.abs(w).max(axis=0) / WEIGHT_LEVELS_8, pairs / bound)
    scale = np.where(need > 0, need, 1.0).astype(np.float32)
    v = w / scale.astype(np.float64)
    q = np.clip(np.rint(v), -WEIGHT_LEVELS_8, WEIGHT_LEVELS_8)
    for sign in (1.0, -1.0):
        part = np.maximum(sign * q, 0.0)
        over = (part[0::2] + part[1::2]) > bound  # (E / 2, N), at most one level over
        away = sign * (q - v)  # how far rounding carried each value away from zero on this side
        first = away[0::2] >= away[1::2]
        q[0::2] -= sign * (over & first)
        q[1::2] -= sign * (over & ~first)
    return q[:rows].astype(np.int8), scale


class Exact:
    """Every operation exact in the arrays' dtype: float64 for the oracle, float32 for a float32 run."""

    name = "exact"

    def cast(self, x: np.ndarray) -> np.ndarray:
        """What storing an intermediate result does to it."""
        return x

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """``x @ weight.T + bias`` (torch's Linear layout: weight is (N, E))."""
        return x @ weight.T + bias

    def float_linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """A weight product the scheme keeps in float (a classification head's): only stored results rounded."""
        return self.cast(x @ self.cast(weight).T + self.cast(bias))


class Int8(Exact):
    """export/int8.py's scheme, computed exactly in the arrays' dtype, in the ``form`` an artifact records
    (``Form``): each row of ``x`` quantized to 8 bits with its own step and exact offset, the weight per output
    column; the input channels named in ``float_channels`` (by weight name, as the artifact's manifest records
    them under ``scheme``) leave the integer product and are multiplied in float. ``weights``: the arrays
    ``forward`` is given, to know each weight's name (needed only with ``float_channels``)."""

    name = "int8"

    def __init__(
        self,
        float_channels: Mapping[str, Sequence[int]] | None = None,
        weights: Mapping[str, np.ndarray] | None = None,
        form: Form = DEFAULT_FORM,
    ) -> None:
        self._channels = {k: np.asarray(v, np.int64) for k, v in (float_channels or {}).items()}
        if self._channels and weights is None:
            raise ValueError("Int8 with float channels needs the weights, to name each weight it is given")
        self._names = {id(w): k for k, w in (weights or {}).items()}
        self.form = form
        # id -> (weight, dequantized rest, float rows, what base and centre are carried by, channels)
        self._weights: dict[int, tuple[np.ndarray, ...]] = {}

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        kept = self._weights.get(id(weight))
        if kept is None or kept[0] is not weight:
            idx = self._channels.get(self._names.get(id(weight), ""), np.zeros(0, np.int64))
            rest = weight.T.astype(np.float64)  # the graph's (E, N)
            rest[idx] = 0.0
            wq, scale = self.form.quantize(rest)
            deq = wq.astype(np.float64) * scale.astype(np.float64)
            sums = (deq.sum(axis=0), rest.sum(axis=0))  # what base and centre are carried by
            arrays = (a.astype(x.dtype) for a in (deq, weight.T[idx], *sums))
            kept = self._weights[id(weight)] = (weight, *arrays, idx)
        _, deq, rows, base_w, centre_w, idx = kept
        levels, step, base, centre = self.form.rows_of(x, idx)
        return (levels @ deq) * step + (base * base_w + centre * centre_w + x[..., idx] @ rows) + bias


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
    form and float channels); None for a variant this module does not know. ``weights``: the arrays it will be given."""
    if variant == "int8":
        return Int8((plan or {}).get(FLOAT_CHANNELS_KEY), weights, Form.of(plan))
    return {"fp32": Exact, "fused": Exact, "fp16": Half}.get(variant, lambda: None)()


def float_channel_count(width: int) -> int:
    """How many of a weight product's ``width`` input channels int8 keeps in float."""
    return min(FLOAT_CHANNELS, width // 16)
