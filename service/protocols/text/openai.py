"""OpenAI's embeddings API: ``POST /v1/embeddings``, as the official ``openai`` client calls it
(``OpenAI(base_url=".../v1").embeddings.create(model=..., input=...)``), and at ``POST /embeddings`` and ``GET
/models`` too, where text-embeddings-inference and Infinity serve it (a client whose base URL has no ``/v1``).

``input``: a string, a list of strings, a list of token ids or a list of such lists; ``model``: a served model's name
(``GET /v1/models`` lists them); ``encoding_format``: ``float`` (default) or ``base64`` (little-endian float32,
what the client asks for by default), or a quantized form as JSON integers (``int8``, ``uint8``, ``binary``,
``ubinary``: sentence-transformers'); ``embedding_type`` (not OpenAI's): the quantized form, with ``base64`` its
bytes; vLLM's ``embed_dtype`` and ``endianness`` of float vectors' base64, and its ``bytes`` and ``bytes_only``
(encodings.py); ``dimensions``: the first N values, normalized again (Matryoshka). The answer
is ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "model", "usage"}`` in
input order. ``truncate`` (not OpenAI's; TEI's and vLLM's idea): cut inputs over the model's length instead of a 413.
``truncate_prompt_tokens`` (vLLM's): -1 cuts at the model's length, k keeps each input's last k tokens (special
tokens included; ``truncation_direction: right`` its first k instead).
"""

from __future__ import annotations

import base64
import re
import time

import numpy as np
import orjson
from fastapi import APIRouter

from addnorm.model.quantize import FLOAT, PRECISIONS
from addnorm.service.core.text import EMBEDDING_TYPES, embedding_type, sentence_vectors, text_inputs
from addnorm.service.errors import BadInput, quote
from addnorm.service.guard import Known
from addnorm.service.protocols.common import error_docs, json_positive_int
from addnorm.service.protocols.text import encodings
from addnorm.service.protocols.text.codec import Binary, TextQuery, fields, kept_tokens, text_route

router = APIRouter(tags=["openai"])
# where the API is served: OpenAI's own prefix, and the root as TEI (both) and Infinity (the root only) serve it
PREFIXES = ("/v1", "")
_KNOWN = encodings.FIELDS | {
    "input",
    "model",
    "encoding_format",
    "embedding_type",
    "dimensions",
    "user",
    "truncate",
    "truncation_direction",
    "truncate_prompt_tokens",
    "prompt_name",
    "prompt",
}
# OpenAI's error object (what error_shape writes)
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}
_FORMATS = ("float", "base64", *encodings.BYTES, *PRECISIONS)

REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": {
            "description": "a string, a list of strings, a list of token ids, or a list of token id lists",
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ],
        },
        "model": {
            "type": "string",
            "description": "a served model's name (GET /v1/models); default: the first",
        },
        "encoding_format": {
            "type": "string",
            "enum": list(_FORMATS),
            "default": "float",
            "description": "float or base64 (little-endian bytes of each vector), or a quantized form as integers; "
            + encodings.BYTES_DOC,
        },
        **encodings.REQUEST_DOC,
        "embedding_type": {
            "type": "string",
            "enum": list(EMBEDDING_TYPES),
            "default": "float",
            "description": "the vectors' form: float32, or sentence-transformers' quantized forms (int8, uint8: "
            "ranges calibrated at export; binary, ubinary: 8 dimensions a byte)",
        },
        "dimensions": {
            "type": "integer",
            "minimum": 1,
            "description": "the first N values, normalized again",
        },
        "user": {"type": "string", "description": "accepted and ignored"},
        "truncate": {
            "type": "boolean",
            "description": "cut inputs over the model's length (default: the server's --auto-truncate)",
        },
        "truncation_direction": {"type": "string", "enum": ["right", "left"], "default": "right"},
        "truncate_prompt_tokens": {
            "type": "integer",
            "minimum": -1,
            "nullable": True,
            "description": "vLLM's: -1 cuts at the model's length, k keeps each input's last k tokens",
        },
        "prompt_name": {
            "type": "string",
            "description": "one of the model's prompts (sentence-transformers'), put before each text",
        },
        "prompt": {"type": "string", "description": "a text put before each text"},
    },
}
ANSWER = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"type": "string", "enum": ["embedding"]},
                    "index": {"type": "integer"},
                    "embedding": {
                        "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}},
        },
    },
}
_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": REQUEST,
                "example": {"input": ["hello", "world"], "model": "encoder"},
            }
        },
    },
    "responses": {
        "200": {
            "description": "one embedding per input, in input order",
            "content": {"application/json": {"schema": ANSWER}},
        },
        **error_docs(
            schema=ERROR_SCHEMA,
            descriptions={
                400: "bad input (a field named)",
                401: "missing or invalid API key",
                404: "unknown model",
                413: "too many inputs, or an input over the model's length",
                429: "queue full; retry after Retry-After seconds",
                503: "model not loaded yet",
                504: "not answered within the request timeout",
            },
        ),
    },
}


def read(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _KNOWN, "input")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"model must be a string, got {quote(model)}")
    fmt = doc.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if not isinstance(fmt, str) or fmt not in _FORMATS:
        raise BadInput(f"encoding_format must be one of {list(_FORMATS)}, got {quote(fmt)}")
    precision = embedding_type(doc.get("embedding_type"), "embedding_type")
    if fmt in PRECISIONS:  # a quantized form as JSON integers
        if precision not in (FLOAT, fmt):
            raise BadInput(f"encoding_format {fmt} and embedding_type {precision} disagree: give one")
        fmt, precision = "float", fmt
    # vLLM's: float vectors' bytes in embed_dtype and endianness (OpenAI's base64 is little-endian float32)
    encoding = encodings.read_encoding(doc, fmt, endianness="little")
    if precision != FLOAT and (encoding.as_body or any(doc.get(key) is not None for key in encodings.FIELDS)):
        raise BadInput(
            f"embed_dtype, endianness and encoding_format bytes are for float vectors, not embedding_type "
            f"{precision} (whose bytes encoding_format base64 gives): give one"
        )
    dims = json_positive_int(doc, "dimensions")
    if (user := doc.get("user")) is not None and not isinstance(user, str):
        raise BadInput(f"user must be a string, got {quote(user)}")
    truncate = doc.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise BadInput(f"truncate must be true or false, got {quote(truncate)}")
    side = doc.get("truncation_direction", "right")
    if side not in ("right", "left"):
        raise BadInput(f"truncation_direction must be 'right' or 'left', got {quote(side)}")
    keep = kept_tokens(doc)  # vLLM's: -1 the model's length, k the last k tokens
    if keep is not None:
        if truncate is False:
            raise BadInput("truncate: false and truncate_prompt_tokens disagree: give one")
        truncate = True
        side = doc.get("truncation_direction", "left")  # vLLM keeps the last tokens
    inputs = text_inputs(doc["input"], "input", max_inputs)
    for field in ("prompt_name", "prompt"):
        if (value := doc.get(field)) is not None and not isinstance(value, str):
            raise BadInput(f"{field} must be a string, got {quote(value)}")
    options = {"encoding": encoding, "dimensions": dims}
    return TextQuery(
        model,
        inputs,
        truncate,
        options,
        doc.get("prompt_name"),
        prompt_text=doc.get("prompt"),
        direction=side,
        precisions=(precision,),
        max_tokens=None if keep is None or keep == -1 else keep,
    )


def write(req, model, outputs) -> bytes | Binary:
    dims, encoding = req.options["dimensions"], req.options["encoding"]
    # Matryoshka: cut, then normalize again
    out = sentence_vectors(req, model, outputs, True if dims is not None else None, dims)
    if encoding.as_body:  # vLLM's bytes (float vectors only: read refuses a quantized form)
        return encodings.bytes_answer("embd", model.name, req.tokens, list(out), encoding)
    if encoding.form == "base64":
        # each vector's bytes: float ones in embed_dtype and endianness, a quantized form's as they are
        floats = out.dtype == np.float32
        data = [
            base64.b64encode(encodings.output_bytes(r, encoding) if floats else r.tobytes()).decode()
            for r in out
        ]
    else:
        data = list(out)  # float32 rows: orjson writes each value's shortest float32 form
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(data)],
            "model": model.name,
            "usage": {"prompt_tokens": req.tokens, "total_tokens": req.tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


async def models(known: Known) -> dict:
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "addnorm"}
            for name in (m.name for m in known.models)
        ],
    }


for prefix in PREFIXES:
    text_route(
        router,
        f"{prefix}/embeddings",
        "openai",
        read,
        write,
        "Embeddings of texts or token ids (OpenAI's API)",
        encodings.with_bytes_answer(_DOC),
    )
    router.add_api_route(
        f"{prefix}/models",
        models,
        methods=["GET"],
        name=f"{prefix.strip('/')}_models".lstrip("_"),
        summary="The served models (OpenAI's list)",
        responses=error_docs({401: "missing or invalid API key"}, ERROR_SCHEMA),
    )

MODEL_PREFIXES = ("/v1/", "/embeddings", "/models")
ERROR_PATHS = tuple(f"{prefix}{path}" for prefix in PREFIXES for path in ("/embeddings", "/models"))
_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


def error_shape(status: int, message: str) -> dict:
    """OpenAI's error object, which its clients read (``openai.APIStatusError.message``): the field at fault as
    ``param`` when the message starts with one."""
    kind = "server_error" if status >= 500 else "requests" if status == 429 else "invalid_request_error"
    field = (
        re.match(r"([a-z_]+)\b", message) if status in (400, 413) else None
    )  # a refused field names itself
    param = field[1] if field and field[1] in _KNOWN else None
    code = _CODES.get(status) if status != 404 or "model" in message else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


PUBLIC_PATHS: tuple[str, ...] = ()
