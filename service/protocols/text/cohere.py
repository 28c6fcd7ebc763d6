"""Cohere's embed API, as the official ``cohere`` client calls it: ``POST /v2/embed``
(``cohere.ClientV2(base_url=...).embed(model=..., texts=[...], input_type=..., embedding_types=[...])``) and
``POST /v1/embed`` (``cohere.Client(base_url=...).embed(texts=[...])``, the client's first API, still its default
client).

``{"model", "texts": [str], "input_type", "embedding_types": ["float" | "int8" | "uint8" | "binary" | "ubinary" |
"base64"], "truncate": "NONE" | "START" | "END", "output_dimension", "max_tokens"}`` -> ``{"id", "embeddings":
{type: [...]}, "texts", "meta", "response_type": "embeddings_by_type"}``, each type's vectors in input order.
``/v1/embed`` takes the same fields less v2's own (``output_dimension``, ``max_tokens``, ``inputs``, ``priority``:
unknown there) and, without ``embedding_types``, answers v1's ``{"id", "embeddings": [[float]], "texts", "meta",
"response_type": "embeddings_floats"}``.

``input_type`` picks the model's prompt as sentence-transformers' ``encode_query`` / ``encode_document`` do:
``search_query`` the prompt named ``search_query`` or ``query``; ``search_document`` ``search_document``,
``document``, ``passage`` or ``corpus``; ``classification`` and ``clustering`` their own names; the model's default
where it has none of them. The quantized types are sentence-transformers' (model/quantize.py: int8 and uint8 against
the ranges calibrated at export, not Cohere's own), ``base64`` the little-endian float32 bytes. ``truncate``
(Cohere's default ``END``): ``START`` cuts an input's start, ``END`` its end, ``NONE`` refuses an input over the
model's length (413). ``output_dimension``: the first N values, normalized again (Matryoshka). ``max_tokens``: each
text's tokens at most (special tokens included; above the model's length, the model's), cut as ``truncate`` says or,
with ``NONE``, refused (413). Errors are Cohere's ``{"message"}``.
"""

from __future__ import annotations

import base64
import uuid

import orjson
from fastapi import APIRouter

from addnorm.model.quantize import FLOAT
from addnorm.service.core.text import EMBEDDING_TYPES, quantized, sentence_vectors
from addnorm.service.errors import BadInput, quote
from addnorm.service.protocols.common import error_docs, json_positive_int, json_route_doc
from addnorm.service.protocols.text import rerank
from addnorm.service.protocols.text.codec import TextQuery, fields, text_list, text_route

router = APIRouter(tags=["cohere"])
_KNOWN_V1 = {"model", "texts", "images", "input_type", "embedding_types", "truncate"}
_KNOWN = {*_KNOWN_V1, "inputs", "output_dimension", "max_tokens", "priority"}
BASE64 = "base64"
TYPES = (*EMBEDDING_TYPES, BASE64)
# Cohere's input types -> the model's prompts that serve them, first found first (sentence-transformers' names)
INPUT_PROMPTS = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
_TRUNCATE = {"END": (True, "right"), "START": (True, "left"), "NONE": (False, "right")}
_VECTORS = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
_BY_TYPE = {
    "type": "object",
    "properties": {
        **{name: _VECTORS for name in EMBEDDING_TYPES},
        BASE64: {"type": "array", "items": {"type": "string"}},
    },
}


def _doc(version: int) -> dict:
    """The OpenAPI entry of /v{version}/embed."""
    fields = {
        "model": {"type": "string"},
        "texts": {"type": "array", "items": {"type": "string"}},
        "input_type": {"type": "string", "enum": list(INPUT_PROMPTS)},
        "embedding_types": {"type": "array", "items": {"type": "string", "enum": list(TYPES)}},
        "truncate": {"type": "string", "enum": list(_TRUNCATE), "default": "END"},
    }
    if version == 2:
        fields["output_dimension"] = {"type": "integer", "minimum": 1, "nullable": True}
        fields["max_tokens"] = {
            "type": "integer",
            "minimum": 1,
            "nullable": True,
            "description": "each text's tokens at most (special tokens included), cut as truncate says",
        }
        fields["priority"] = {"type": "integer", "description": "accepted and ignored"}
    example = {
        "texts": ["What is Deep Learning?"],
        "input_type": "search_query",
        "embedding_types": ["float", "int8"],
    }
    return json_route_doc(
        ["texts"],
        fields,
        example,
        {
            "type": "object",
            "properties": dict(  # (keywords: Cohere's "embeddings" is not the graph's input of that name)
                id={"type": "string"},
                # v1 without embedding_types: the float vectors themselves (response_type embeddings_floats)
                embeddings=_BY_TYPE if version == 2 else {"oneOf": [_VECTORS, _BY_TYPE]},
                texts={"type": "array", "items": {"type": "string"}},
                meta={"type": "object"},
                response_type={"type": "string"},
            ),
        },
        "each asked type's vectors, in input order",
        error_docs(
            {
                400: "bad input (a field named)",
                401: "missing or invalid API key",
                404: "unknown model",
                413: "too many texts, or one over the model's length with truncate NONE",
                429: "queue full; retry after Retry-After seconds",
                503: "model not loaded yet",
            },
            rerank.ERROR_SCHEMA,
        ),
    )


def read(doc: object, max_inputs: int) -> TextQuery:
    """/v2/embed's request."""
    return _read(fields(doc, _KNOWN, "texts"), max_inputs, 2)


def read_v1(doc: object, max_inputs: int) -> TextQuery:
    """/v1/embed's request: v2's fields less its own; no ``embedding_types``: v1's float response."""
    return _read(fields(doc, _KNOWN_V1, "texts"), max_inputs, 1)


def _read(doc: dict, max_inputs: int, version: int) -> TextQuery:
    for name in ("images", "inputs"):
        if doc.get(name) is not None:
            raise BadInput(f"{name} is not supported: this server embeds texts; send texts")
    max_tokens = json_positive_int(doc, "max_tokens")
    texts = text_list(doc["texts"], "texts", max_inputs)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"model must be a string, got {quote(model)}")
    input_type = doc.get("input_type")
    if input_type is not None and (not isinstance(input_type, str) or input_type not in INPUT_PROMPTS):
        raise BadInput(f"input_type must be one of {list(INPUT_PROMPTS)}, got {quote(input_type)}")
    asked = doc.get("embedding_types")
    types = [FLOAT] if asked is None else asked
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in TYPES for t in types):
        raise BadInput(f"embedding_types must be a non-empty list of {list(TYPES)}, got {quote(types)}")
    truncate = doc.get("truncate", "END")
    if not isinstance(truncate, str) or truncate not in _TRUNCATE:
        raise BadInput(f"truncate must be one of {list(_TRUNCATE)}, got {quote(truncate)}")
    dims = json_positive_int(doc, "output_dimension")
    cut, side = _TRUNCATE[truncate]
    forms = tuple(dict.fromkeys(FLOAT if t == BASE64 else t for t in types))  # each asked once
    return TextQuery(
        model,
        texts,
        cut,
        {
            "types": list(dict.fromkeys(types)),
            "dimensions": dims,
            "texts": texts,
            "version": version,
            "floats": version == 1 and asked is None,  # v1's embeddings_floats answer
        },
        field="texts",
        direction=side,
        precisions=forms,
        precision_field="embedding_types",
        prompt_names=INPUT_PROMPTS.get(input_type, ()),
        max_tokens=max_tokens,
    )


def write(req, model, outputs) -> bytes:
    dims = req.options["dimensions"]
    normalized = True if dims is not None else model.engine.manifest.config.normalize_pooled
    floats = sentence_vectors(req, model, outputs, normalized, dims, FLOAT)  # Matryoshka: cut, then normalize
    meta = {
        "api_version": {"version": str(req.options["version"])},
        "billed_units": {"input_tokens": req.tokens},
    }
    embeddings: object = floats  # v1's embeddings_floats: the vectors themselves
    if not req.options["floats"]:
        embeddings = {
            name: [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in floats]
            if name == BASE64
            else quantized(model, floats, name, dims, normalized)
            for name in req.options["types"]
        }
    return orjson.dumps(
        dict(
            id=str(uuid.uuid4()),
            embeddings=embeddings,
            texts=req.options["texts"],
            meta=meta,
            response_type="embeddings_floats" if req.options["floats"] else "embeddings_by_type",
        ),
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


text_route(router, "/v2/embed", "cohere", read, write, "Embeddings of texts (Cohere's API)", _doc(2))
text_route(router, "/v1/embed", "cohere", read_v1, write, "Embeddings of texts (Cohere's v1 API)", _doc(1))

MODEL_PREFIXES = ("/v2/embed",)  # /v1/embed is under the openai module's /v1/
ERROR_PATHS = ("/v1/embed", "/v2/embed")
PUBLIC_PATHS: tuple[str, ...] = ()
error_shape = rerank.error_shape  # Cohere's {"message"}
