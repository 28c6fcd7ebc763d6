"""The rerank API of Cohere, Jina and vLLM: ``POST /v1/rerank`` and ``POST /v2/rerank``, as the official ``cohere``
client calls them (``cohere.ClientV2(base_url=...).rerank(model=..., query=..., documents=[...], top_n=...)``).

``{"model", "query", "documents": [str | {"text": str}], "top_n": null, "return_documents": false}`` ->
``{"id", "results": [{"index", "relevance_score", "document"?: {"text"}}], "meta", "usage"}``, best first, the first
``top_n`` (all when null; more than there are documents gives them all, as Cohere does). Each document is scored
with the query as a pair by a cross-encoder (a served model whose task is rerank), its relevance the sigmoid of its
logit (sentence-transformers' CrossEncoder), or the logit itself with ``raw_scores`` (Infinity's); a document over
the model's length is cut, never the query (Cohere truncates long documents rather than refuse them), and over
``max_tokens_per_doc`` of its own tokens (Cohere v2's) cut to them. Errors are Cohere's ``{"message"}``.
"""

from __future__ import annotations

import uuid

import numpy as np
import orjson
from fastapi import APIRouter

from addnorm.service.core.text import scores
from addnorm.service.errors import BadInput, quote
from addnorm.service.protocols.common import error_docs, json_bool, json_positive_int, json_route_doc
from addnorm.service.protocols.text.codec import TextQuery, fields, query_text, text_list, text_route

router = APIRouter(tags=["rerank"])
_KNOWN = {
    "model",
    "query",
    "documents",
    "top_n",
    "return_documents",
    "rank_fields",
    "max_chunks_per_doc",
    "max_tokens_per_doc",
    "raw_scores",  # Infinity's: the logits, not their sigmoid
}
ERROR_SCHEMA = {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}
_ERRORS = error_docs(
    {
        400: "bad input (a field named), or a model that does not rerank",
        401: "missing or invalid API key",
        404: "unknown model",
        413: "too many documents, or a query over the model's length",
        429: "queue full; retry after Retry-After seconds",
        503: "model not loaded yet",
    },
    ERROR_SCHEMA,
)
_RESULT = {
    "type": "object",
    "properties": {
        "index": {"type": "integer"},
        "relevance_score": {"type": "number"},
        "document": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
}
_DOCUMENT = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
DOC = json_route_doc(
    ["query", "documents"],
    {
        "model": {"type": "string"},
        "query": {"type": "string"},
        "documents": {"type": "array", "items": {"oneOf": [{"type": "string"}, _DOCUMENT]}},
        "top_n": {"type": "integer", "minimum": 1, "nullable": True},
        "return_documents": {"type": "boolean", "default": False},
        "raw_scores": {
            "type": "boolean",
            "default": False,
            "description": "the logits instead of their sigmoid (Infinity's)",
        },
        "max_tokens_per_doc": {
            "type": "integer",
            "minimum": 1,
            "nullable": True,
            "description": "each document's own tokens at most (cut at its end)",
        },
    },
    {"query": "What is Deep Learning?", "documents": ["Deep Learning is ...", "Paris is ..."]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "results": {"type": "array", "items": _RESULT},
            "meta": {"type": "object"},
            "usage": {"type": "object"},
        },
    },
    "the documents by relevance, best first",
    _ERRORS,
)


def _documents(value: object, max_inputs: int) -> list[str]:
    """Cohere's documents: strings, or objects with a ``text`` (v1's form)."""
    if isinstance(value, list):
        value = [v["text"] if isinstance(v, dict) and set(v) == {"text"} else v for v in value]
    return text_list(value, "documents", max_inputs)


def read(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _KNOWN, "query")
    query = query_text(doc["query"])
    if "documents" not in doc:
        raise BadInput("missing field 'documents'")
    documents = _documents(doc["documents"], max_inputs)
    top_n = json_positive_int(doc, "top_n")
    for name in ("rank_fields", "max_chunks_per_doc"):
        if doc.get(name) is not None:
            raise BadInput(
                f"{name} is not supported: each document is scored whole, cut at the model's length"
            )
    per_doc = json_positive_int(doc, "max_tokens_per_doc")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"model must be a string, got {quote(model)}")
    options = {
        "raw": json_bool(doc, "raw_scores", "body", False),
        "top_n": top_n,
        "documents": documents if json_bool(doc, "return_documents", "body", False) else None,
    }
    return TextQuery(
        model,
        [query] * len(documents),
        True,
        options,
        field="documents",
        seconds=documents,
        tasks=("rerank",),
        max_tokens=per_doc,
    )


def write(req, model, outputs) -> bytes:
    relevance = scores(outputs, req.options["raw"])[:, 0]
    order = np.argsort(-relevance, kind="stable")[: req.options["top_n"]]
    documents = req.options["documents"]
    results = [
        {
            "index": int(i),
            "relevance_score": float(relevance[i]),
            **({"document": {"text": documents[i]}} if documents is not None else {}),
        }
        for i in order
    ]
    return orjson.dumps(
        {
            "id": str(uuid.uuid4()),
            "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
            "usage": {"total_tokens": req.tokens},
        }
    )


for path in ("/v1/rerank", "/v2/rerank"):
    text_route(
        router,
        path,
        "rerank",
        read,
        write,
        "Documents ranked by relevance (Cohere's, Jina's, vLLM's API)",
        DOC,
    )


MODEL_PREFIXES = ("/v2/rerank",)  # /v1/rerank is under the openai module's /v1/
ERROR_PATHS = ("/v1/rerank", "/v2/rerank")
PUBLIC_PATHS: tuple[str, ...] = ()


def error_shape(status: int, message: str) -> dict:
    """Cohere's error body: ``{"message"}``."""
    return {"message": message}
