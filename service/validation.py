"""Validation every protocol shares: JSON bodies, and decoded (B, S, E) batches against the model."""

from __future__ import annotations

import numpy as np
import orjson

from model.contract import EMBEDDINGS, MASK
from service.errors import BadInput, TooLarge


def parse_json(body: bytes, max_elements: int) -> object:
    """Parse a JSON body, refusing one that holds more numbers than any acceptable tensor before parsing it."""
    if not body:
        raise BadInput("request body is empty; send a JSON object")
    # Refuse oversized arrays before building millions of Python floats: a dense array of N values has N - 1
    # commas, and a mask at most as many again.
    if body.count(b",") > 2 * max_elements:
        raise TooLarge(f"request holds more than {max_elements} values (ADDNORM_MAX_ELEMENTS); split it")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        hint = (
            " (NaN and Infinity are not valid JSON numbers)" if b"NaN" in body or b"Infinity" in body else ""
        )
        raise BadInput(f"malformed JSON: {exc}{hint}") from None


def check_batch(x: np.ndarray, mask: np.ndarray | None, d_model: int, max_elements: int) -> None:
    """What every decoded request must be: (B, S, d_model), within the size limit, finite, mask (B, S)."""
    if x.ndim != 3:
        raise BadInput(f"{EMBEDDINGS} must be [batch, seq, d_model], got shape {list(x.shape)}")
    if x.shape[-1] != d_model:
        raise BadInput(f"{EMBEDDINGS} last dimension is {x.shape[-1]} but the model's d_model is {d_model}")
    if x.size == 0:
        raise BadInput(f"{EMBEDDINGS} is empty (shape {list(x.shape)})")
    if x.size > max_elements:
        raise TooLarge(
            f"{EMBEDDINGS} has {x.size} elements, above this server's limit of {max_elements} "
            "(ADDNORM_MAX_ELEMENTS); split the batch"
        )
    if not np.isfinite(x).all():
        raise BadInput(
            f"{EMBEDDINGS} must be finite: found NaN or Infinity, or a value too large for float32"
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise BadInput(
            f"{MASK} shape {list(mask.shape)} does not match {EMBEDDINGS} [batch, seq] {list(x.shape[:2])}"
        )


def holds_literal(data: list) -> bool:
    """Whether a parsed JSON array (lists in lists) holds true, false or null anywhere: numpy reads true and false
    as 1 and 0, so numeric data is checked before it is converted. One C-speed ``map`` per inner list."""
    stack = [data]
    while stack:
        level = stack.pop()
        types = set(map(type, level))
        if bool in types or _NONE in types:
            return True
        if list in types:
            stack.extend(x for x in level if type(x) is list)
    return False


_NONE = type(None)
