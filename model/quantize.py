"""Quantized sentence vectors, as sentence-transformers' ``quantize_embeddings`` defines them (what a vector index
stores at 1 byte or 1 bit a dimension), and the calibration their 8-bit forms are measured against.

- ``int8`` / ``uint8``: each dimension cut into 255 equal steps between its least and greatest value over the
  calibration vectors (``ranges``), a value's step floored and clipped to 0..255; ``int8`` is that less 128.
- ``binary`` / ``ubinary``: one bit a dimension, set where the value is above 0, packed 8 to a byte, first
  dimension in the high bit (``numpy.packbits``); ``binary`` is each byte less 128 as int8.

- narrow floats (``narrow_float_bits``): ``bfloat16``, ``fp8_e4m3`` and ``fp8_e5m2``, each value's bit pattern as
  torch's ``Tensor.to`` rounds a float32 to it (what vLLM's ``embed_dtype`` answers in), in numpy alone: the serving
  side has no torch and numpy has none of these types.

The ranges come from the calibration vectors, computed once at export on real sentences (built-in, or the export's
``--calibration`` sentences) and kept in the artifact (``calibration.safetensors``), never from a request's own
vectors: an answer never depends on its batch-mates. They are kept unnormalized and whole, so the ranges of any
served form follow from them: cut to a request's first ``dimensions`` and normalized where the answer is.
"""

from __future__ import annotations

import numpy as np

CALIBRATION_FILE = "calibration.safetensors"
VECTORS = "vectors"  # the calibration sentences' pooled vectors, unnormalized (N, D) float32
FLOAT = "float"
PRECISIONS = ("int8", "uint8", "binary", "ubinary")  # the quantized forms
CALIBRATED = ("int8", "uint8")  # the forms that need ranges
DTYPES = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def ranges(calibration: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """(2, d) float32: each dimension's least and greatest value over the calibration vectors as a request's
    answer has them: their first ``dimensions`` (None: all), L2-normalized when ``normalized``."""
    vectors = np.asarray(calibration, np.float32)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalized:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32)


def quantize(vectors: np.ndarray, precision: str, bounds: np.ndarray | None = None) -> np.ndarray:
    """(N, D) float32 vectors in ``precision`` (one of PRECISIONS): (N, D) int8/uint8, or (N, ceil(D / 8)) packed
    bits; ``bounds``: ``ranges``' (2, D) for int8 and uint8. sentence-transformers' arithmetic, step for step."""
    if precision in CALIBRATED:
        if bounds is None:
            raise ValueError(f"{precision} needs the calibration's ranges")
        starts = bounds[0]
        steps = (bounds[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        q = np.clip(np.floor((np.asarray(vectors, np.float32) - starts) / steps), 0, 255)
        return q.astype(np.uint8) if precision == "uint8" else (q - 128).astype(np.int8)
    if precision in ("binary", "ubinary"):
        bits = np.packbits(vectors > 0, axis=-1)
        return bits if precision == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


# A narrow float's layout: its exponent bias and mantissa bits, the float32 bit pattern from which a value is beyond
# its range, and below which it is subnormal, where rounding adds 2**k in float32 (k: the exponent that puts the
# subnormals' last bit at float32's), as c10's Float8_e4m3fn and Float8_e5m2 do; what a value beyond the range is.
# e4m3fn has no infinity: torch 2.13 saturates at 448 (from 448.0 on: values past 464 would round to NaN's pattern).
_FP8 = {
    "fp8_e4m3": (7, 3, 0x43E00000, 121 << 23, 141 << 23, 0x7E),
    "fp8_e5m2": (15, 2, 143 << 23, 113 << 23, 134 << 23, 0x7C),  # from 65536.0 on: infinity (largest 57344)
}
NARROW_FLOATS = ("bfloat16", *_FP8)


def narrow_float_bits(values: np.ndarray, form: str) -> np.ndarray:
    """float32 ``values`` as ``form``'s bit patterns (one of NARROW_FLOATS): uint16 for bfloat16, uint8 for fp8, the
    same shape; rounded to the nearest, ties to even, as torch rounds them (``Tensor.to``), step for step. (An
    answer is finite: a NaN's pattern is c10's, which torch's vectorized bfloat16 path does not keep.)"""
    floats = np.ascontiguousarray(values, np.float32)
    bits = floats.view(np.uint32).astype(np.int64)
    if form == "bfloat16":
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return np.where(np.isnan(floats), 0x7FC0, rounded).astype(np.uint16)
    if form not in _FP8:
        raise ValueError(f"form must be one of {NARROW_FLOATS}, got {form!r}")
    bias, mantissa, too_big, normal, denorm, beyond = _FP8[form]
    shift = 23 - mantissa
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    # subnormal: float32's own rounding, adding a power of two that leaves only the subnormal's bits below it
    subnormal = (magnitude.astype(np.uint32).view(np.float32) + np.uint32(denorm).view(np.float32)).view(
        np.uint32
    )
    small = subnormal.astype(np.int64) - denorm
    odd = (magnitude >> shift) & 1
    big = (magnitude + ((bias - 127) << 23) + (1 << (shift - 1)) - 1 + odd) >> shift
    out = np.where(magnitude < normal, small, big)
    out = np.where(magnitude >= too_big, np.where(magnitude > 0x7F800000, 0x7F, beyond), out)  # NaN stays NaN
    return ((out & 0xFF) | (sign >> 24)).astype(np.uint8)


def save(path, vectors: np.ndarray, sentences: int) -> None:
    """The calibration file: ``vectors`` (N, D) float32 and how many sentences they are."""
    from safetensors.numpy import save_file

    save_file(
        {VECTORS: np.ascontiguousarray(vectors, np.float32)},
        str(path),
        metadata={"sentences": str(sentences)},
    )


def load(data: bytes) -> np.ndarray:
    """The calibration vectors (N, D) float32 from the file's bytes."""
    from safetensors.numpy import load as load_bytes

    vectors = load_bytes(data).get(VECTORS)
    if vectors is None or vectors.ndim != 2 or vectors.shape[0] < 2 or vectors.dtype != np.float32:
        raise ValueError(f"{CALIBRATION_FILE} must hold '{VECTORS}': (N >= 2, D) float32")
    return vectors
