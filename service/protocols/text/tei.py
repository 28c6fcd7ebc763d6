"""text-embeddings-inference's API, so its clients switch by URL: ``POST /embed`` and ``POST /tokenize``.

``/embed``: ``{"inputs": str | [str], "normalize": true, "truncate": false, "prompt_name": null, "dimensions":
null}`` -> ``[[float, ...], ...]``, one vector per input in input order. ``/tokenize``: ``{"inputs": str | [str],
"add_special_tokens": true}`` -> per input, its tokens as ``{"id", "text", "special", "start", "stop"}``. Both on the
default model (TEI serves one); errors are this server's ``{"error": ...}``.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Response

from addnorm.model.tokenize import TooManyChars
from addnorm.service.core.inference import offload, work
from addnorm.service.core.text import text_inputs, vectors
from addnorm.service.errors import BadInput, TooLarge, quote
from addnorm.service.guard import Known
from addnorm.service.protocols.common import error_docs, json_bool, parse_json, read_body
from addnorm.service.protocols.text.codec import TEXT_WORK, TextQuery, answer, fields, pooling

router = APIRouter(tags=["tei"])
_EMBED = {"inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions"}
_TOKENIZE = {"inputs", "add_special_tokens", "prompt_name"}
# text-embeddings-inference's error body (what error_shape writes)
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string", "enum": ["validation", "overloaded", "unhealthy", "backend"]},
    },
}
_ERRORS = error_docs(
    {
        400: "bad input (a field named)",
        401: "missing or invalid API key",
        413: "too many inputs, or an input over the model's length",
        429: "queue full; retry after Retry-After seconds",
        503: "model not loaded yet",
    },
    ERROR_SCHEMA,
)
_INPUTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}


def _doc(properties: dict, answer: dict, example: dict) -> dict:
    schema = {"type": "object", "required": ["inputs"], "properties": {"inputs": _INPUTS, **properties}}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema, "example": example}},
        },
        "responses": {
            "200": {
                "description": "one entry per input",
                "content": {"application/json": {"schema": answer}},
            },
            **_ERRORS,
        },
    }


_EMBED_DOC = _doc(
    {
        "normalize": {"type": "boolean", "default": True},
        "truncate": {"type": "boolean", "default": False},
        "truncation_direction": {"type": "string", "enum": ["Right"], "default": "Right"},
        "prompt_name": {"type": "string", "nullable": True},
        "dimensions": {"type": "integer", "minimum": 1, "nullable": True},
    },
    {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    {"inputs": "What is Deep Learning?"},
)
_TOKEN = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "special": {"type": "boolean"},
        "start": {"type": "integer", "nullable": True},
        "stop": {"type": "integer", "nullable": True},
    },
}
_TOKENIZE_DOC = _doc(
    {
        "add_special_tokens": {"type": "boolean", "default": True},
        "prompt_name": {"type": "string", "nullable": True},
    },
    {"type": "array", "items": {"type": "array", "items": _TOKEN}},
    {"inputs": "What is Deep Learning?"},
)


def _prompt_name(doc: dict) -> str | None:
    name = doc.get("prompt_name")
    if name is not None and not isinstance(name, str):
        raise BadInput(f"prompt_name must be a string, got {quote(name)}")
    return name


def _texts(doc: dict, max_inputs: int) -> list[str]:
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    if not isinstance(inputs[0], str):
        raise BadInput("inputs must be a string or a list of strings")
    return inputs


def read(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _EMBED, "inputs")
    if doc.get("truncation_direction", "Right") != "Right":
        raise BadInput("truncation_direction must be 'Right' (the end of an input is cut)")
    dims = doc.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise BadInput(f"dimensions must be a positive integer, got {quote(dims)}")
    options = {"normalize": json_bool(doc, "normalize", "body", True), "dimensions": dims}
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    truncate = json_bool(doc, "truncate", "body", False)
    return TextQuery(None, inputs, truncate, options, _prompt_name(doc), field="inputs")


def write(req, model, outputs) -> bytes:
    pooled_by, normalized = pooling(model)
    out = vectors(req, outputs, pooled_by, normalized, req.options["normalize"], req.options["dimensions"])
    return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


@router.post(
    "/embed", summary="Embeddings of texts (text-embeddings-inference's API)", openapi_extra=_EMBED_DOC
)
async def embed(request: Request, known: Known) -> Response:
    return await answer(request, known, "tei", read, write)


@router.post(
    "/tokenize", summary="Tokens of texts (text-embeddings-inference's API)", openapi_extra=_TOKENIZE_DOC
)
async def tokenize(request: Request, known: Known) -> Response:
    """Read under the body limit as every route is; each text within the model's characters before it is
    tokenized; the answer at most as many tokens as /embed could take in one request; big work off the loop."""
    s = known.settings
    body = await read_body(request, s.max_body_bytes)
    amount = work(TEXT_WORK * len(body))
    doc = fields(await offload(amount, parse_json, body, s.max_elements), _TOKENIZE, "inputs")
    model = known.models.get(None)
    front = model.engine.text
    if front is None:
        raise BadInput(f"model {quote(model.name)} takes embeddings, not text: export it with --inputs ids")
    texts = front.prompted(_texts(doc, s.max_client_batch_size), _prompt_name(doc))
    special = json_bool(doc, "add_special_tokens", "body", True)
    try:
        front.tokenizer.within(texts)
    except TooManyChars as exc:
        raise TooLarge(f"inputs[{exc.index}] has {exc.chars} characters, {exc.reason}: shorten it") from None
    rows = await offload(amount, front.tokenizer.tokens, texts, special)
    limit = s.max_client_batch_size * front.config.max_length
    if (total := sum(map(len, rows))) > limit:
        raise TooLarge(
            f"inputs hold {total} tokens, more than /tokenize answers at once ({limit}: ADDNORM_MAX_CLIENT_BATCH_SIZE "
            "x the model's max_length); split the request"
        )
    return Response(await offload(amount, _tokens_json, rows), media_type="application/json")


def _tokens_json(rows: list) -> bytes:
    return orjson.dumps(
        [
            [
                {"id": i, "text": t, "special": sp, "start": None if sp else a, "stop": None if sp else b}
                for i, t, sp, a, b in row
            ]
            for row in rows
        ]
    )


MODEL_PREFIXES = ("/embed", "/tokenize")
ERROR_PATHS = ("/embed", "/tokenize")


def error_shape(status: int, message: str) -> dict:
    """text-embeddings-inference's ``{"error", "error_type"}`` (its ErrorType: validation, overloaded, unhealthy,
    backend)."""
    kind = {429: "overloaded", 503: "unhealthy"}.get(status, "backend" if status >= 500 else "validation")
    return {"error": message, "error_type": kind}


PUBLIC_PATHS: tuple[str, ...] = ()
