"""/v1's binary bodies and answers, for curl users: raw little-endian float32 with its shape in ``X-Shape`` (and
optional row lengths in ``X-Lengths``), or a ``.npy`` file."""

from __future__ import annotations

import io
import math

import numpy as np

from addnorm.service.errors import BadInput, quote

SHAPE_HEADER = "x-shape"  # e.g. "2,128,768"
LENGTHS_HEADER = "x-lengths"  # optional: each row's valid length; positions past it are padding
OCTET, NPY = "application/octet-stream", "application/x-npy"  # the binary media types /v1 reads and answers


def decode_raw(body: bytes, shape_header: str | None) -> np.ndarray:
    if not shape_header:
        raise BadInput(
            f"{OCTET} bodies need an X-Shape header, e.g. 'X-Shape: 2,128,768' ([batch,] seq, d_model)"
        )
    try:
        shape = tuple(int(d) for d in shape_header.split(","))
    except ValueError:
        raise BadInput(f"X-Shape must be comma-separated integers, got {quote(shape_header)}") from None
    if len(shape) not in (2, 3) or min(shape) <= 0:
        raise BadInput(f"X-Shape must be 2 or 3 positive integers ([batch,] seq, d_model), got {list(shape)}")
    expected = math.prod(shape) * 4
    if len(body) != expected:
        raise BadInput(f"body has {len(body)} bytes but X-Shape {list(shape)} of float32 needs {expected}")
    return np.frombuffer(body, dtype="<f4").reshape(shape)  # zero-copy view


def _npy_problem(body: bytes, exc: Exception) -> str:
    """What is wrong with a .npy body, in words: numpy's own message can hold the repr of its parser's objects
    (``<ast.Call object at 0x...>``, for a header holding an expression), which no error may show."""
    if not body.startswith(b"\x93NUMPY"):
        return "it does not start with the .npy magic string (\\x93NUMPY)"
    text = (str(exc).splitlines() or [""])[0]
    if not text or " at 0x" in text or "header" in text.lower() or isinstance(exc, SyntaxError):
        return (
            "its header must be a dict literal of 'descr', 'fortran_order' and 'shape' (np.save writes one)"
        )
    return text[:200]


def decode_npy(body: bytes) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(body), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError/OSError/EOFError/SyntaxError for bad .npy data
        raise BadInput(f"body is not a valid .npy array: {_npy_problem(body, exc)}") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iuf":
        raise BadInput(f".npy array must hold numbers, got dtype {getattr(arr, 'dtype', type(arr))}")
    if arr.ndim not in (2, 3):
        raise BadInput(
            f".npy array must be [seq, d_model] or [batch, seq, d_model], got shape {list(arr.shape)}"
        )
    return arr.astype(np.float32, copy=False)


def lengths_mask(header: str | None, shape: tuple[int, ...]) -> np.ndarray | None:
    if not header:
        return None
    try:
        lengths = np.array([int(n) for n in header.split(",")])
    except ValueError:
        raise BadInput(f"X-Lengths must be comma-separated integers, got {quote(header)}") from None
    b, s = shape[0], shape[1]
    if lengths.shape != (b,) or (lengths < 1).any() or (lengths > s).any():
        raise BadInput(f"X-Lengths must give {b} length(s), each in 1..{s}, got {quote(header)}")
    return np.arange(s)[None, :] >= lengths[:, None]


def encode(result: np.ndarray, media: str) -> bytes:
    if media == NPY:
        buf = io.BytesIO()
        np.save(buf, result.astype("<f4", copy=False), allow_pickle=False)
        return buf.getvalue()
    return result.astype("<f4", copy=False).tobytes()
