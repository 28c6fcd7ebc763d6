"""Quantized sentence vectors, as sentence-transformers' ``quantize_embeddings`` defines them (what a vector index
stores at 1 byte or 1 bit a dimension), and the calibration their 8-bit forms are measured against.

- ``int8`` / ``uint8``: each dimension cut into 255 equal steps between its least and greatest value over the
  calibration vectors (``ranges``), a value's step floored and clipped to 0..255; ``int8`` is that less 128.
- ``binary`` / ``ubinary``: one bit a dimension, set where the value is above 0, packed 8 to a byte, first
  dimension in the high bit (``numpy.packbits``); ``binary`` is each byte less 128 as int8.

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
