"""vLLM's encoded answers, one place for every text API that offers them (vLLM's ``/pooling``, and
``/v1/embeddings`` for vLLM's clients): ``encoding_format`` ``base64`` writes each output's values, flat, in
``embed_dtype`` (float32, float16, or bfloat16, fp8_e4m3, fp8_e5m2 as torch rounds them: model/quantize.py) and
``endianness`` (``native``: the server's); ``bytes`` writes those outputs one after another as the body
(application/octet-stream) with a ``metadata`` header, JSON of the answer's id, created, model, usage and ``data``:
where each output lies (``index``, ``embed_dtype``, ``endianness``, ``start``, ``end``, ``shape``), what vLLM's
``decode_pooling_output`` reads; ``bytes_only`` leaves that header out (the client knows each output's size)."""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass

import numpy as np

from addnorm.model.quantize import NARROW_FLOATS, narrow_float_bits
from addnorm.service.errors import BadInput, quote
from addnorm.service.protocols.text.codec import Binary

BYTES = ("bytes", "bytes_only")  # the formats whose answer is the body itself
DTYPES = ("float32", "float16", *NARROW_FLOATS)
ENDIANNESS = {"native": "=", "little": "<", "big": ">"}
_ORDERS = tuple(ENDIANNESS)
FIELDS = {"embed_dtype", "endianness"}  # the request's fields beside encoding_format
# their OpenAPI entries (the route's own encoding_format lists its formats)
REQUEST_DOC = {
    "embed_dtype": {
        "type": "string",
        "enum": list(DTYPES),
        "default": "float32",
        "description": "base64 and bytes: the values' type (vLLM's)",
    },
    "endianness": {
        "type": "string",
        "enum": list(ENDIANNESS),
        "description": "(vLLM's) default: native, the server's, on /pooling; little on /v1/embeddings (OpenAI's base64)",
    },
}
BYTES_DOC = (
    "bytes: the outputs' bytes as the body (application/octet-stream), where each lies in the metadata header "
    "(vLLM's; bytes_only: without it)"
)


def with_bytes_answer(doc: dict) -> dict:
    """A route's OpenAPI entry (``openapi_extra``) whose 200 answer may also be ``bytes``' body: the outputs' bytes
    as application/octet-stream beside its JSON, and the ``metadata`` header (absent with bytes_only and JSON)."""
    ok = doc["responses"]["200"]
    content = {
        **ok["content"],
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    }
    metadata = {
        "description": "encoding_format bytes: JSON with id, created, model, usage and data (each output's index, "
        "embed_dtype, endianness, start, end and shape in the body), vLLM's",
        "schema": {"type": "string"},
    }
    answer = {**ok, "content": content, "headers": {**ok.get("headers", {}), "metadata": metadata}}
    return {**doc, "responses": {**doc["responses"], "200": answer}}


@dataclass(frozen=True)
class Encoding:
    """How an answer's float vectors are written: ``form`` (float, base64, bytes, bytes_only), in ``dtype`` and
    ``endianness`` (base64 and bytes)."""

    form: str = "float"
    dtype: str = "float32"
    endianness: str = "native"

    @property
    def as_body(self) -> bool:
        return self.form in BYTES


def read_encoding(doc: dict, form: str, endianness: str = "native") -> Encoding:
    """``embed_dtype`` and ``endianness`` of a request whose ``encoding_format`` is ``form`` (already checked
    against its API's formats); ``endianness``: the default where the request names none."""
    dtype, order = doc.get("embed_dtype"), doc.get("endianness")
    if dtype is None and order is None:  # (most requests)
        return _encoding(form, "float32", endianness)
    for key, value, allowed in (("embed_dtype", dtype, DTYPES), ("endianness", order, _ORDERS)):
        if value is not None and value not in allowed:  # (a list or an object is in no tuple of strings)
            raise BadInput(f"{key} must be one of {list(allowed)}, got {quote(value)}")
    return _encoding(form, dtype or "float32", order or endianness)


@functools.cache  # (a few dozen checked values: each request's the same few objects, none built per request)
def _encoding(form: str, dtype: str, endianness: str) -> Encoding:
    return Encoding(form, dtype, endianness)


def output_bytes(values: np.ndarray, encoding: Encoding) -> bytes:
    """One output's values, flat, as vLLM's ``tensor2binary`` writes them: in the encoding's dtype (its narrow
    floats' bit patterns as torch rounds them), in its endianness."""
    floats = np.asarray(values, np.float32)
    dtype = encoding.dtype
    out = narrow_float_bits(floats, dtype) if dtype in NARROW_FLOATS else floats.astype(dtype)
    return out.astype(out.dtype.newbyteorder(ENDIANNESS[encoding.endianness]), copy=False).tobytes()


def bytes_answer(kind: str, model: str, tokens: int, data: list, encoding: Encoding) -> Binary:
    """vLLM's ``bytes`` answer of ``data`` (one array an output): their bytes one after another, and in the
    ``metadata`` header (not for ``bytes_only``) where each lies and its shape, the id (``kind``-...), the model
    and the usage, as its ``encode_pooling_bytes``."""
    parts, items, start = [], [], 0
    for i, values in enumerate(data):
        parts.append(output_bytes(values, encoding))
        end = start + len(parts[-1])
        items.append(
            {
                "index": i,
                "embed_dtype": encoding.dtype,
                "endianness": encoding.endianness,
                "start": start,
                "end": end,
                "shape": list(np.shape(values)),
            }
        )
        start = end
    headers = {}
    if encoding.form == "bytes":
        meta = {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
            "data": items,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        headers["metadata"] = json.dumps(meta)
    return Binary(b"".join(parts), "application/octet-stream", headers)
