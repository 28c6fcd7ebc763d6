"""vLLM's scoring and classification API: ``POST /score`` and ``POST /classify`` (and under ``/v1/``), as vLLM's
server answers them for a cross-encoder and a classifier.

``/score``: ``{"model", "text_1", "text_2", "use_activation": true}`` (or ``data_1``/``data_2``,
``queries``/``documents``, ``queries``/``items``: vLLM's other spellings of the two sides) ->
``{"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}``. Each
side is a string or a list of strings: one first text with N second texts (1:N), or as many of each (N:N), scored
as pairs, in order, by a cross-encoder (a served model whose task is rerank): the sigmoid of its logit
(sentence-transformers' CrossEncoder), the logit itself with ``use_activation: false``.

``/classify``: ``{"model", "input": str | [str] | token ids, "use_activation": true}`` -> ``{"id", "object": "list",
"created", "model", "data": [{"index", "label", "probs", "num_classes"}], "usage"}``: a classifier's (or a
cross-encoder's) probabilities (softmax over several labels, the sigmoid of one), the top label by name.

A text over the model's length is refused, or cut where the server's --auto-truncate says so, as vLLM does;
``truncate_prompt_tokens: -1`` cuts it at the model's length, and k keeps a text's last k tokens (as /v1/embeddings
does; for a pair only -1). Errors are OpenAI's error object, as vLLM's.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import orjson
from fastapi import APIRouter

from addnorm.service.core.text import scores, text_inputs
from addnorm.service.errors import BadInput, quote
from addnorm.service.protocols.common import error_docs, json_bool, json_route_doc
from addnorm.service.protocols.text import openai
from addnorm.service.protocols.text.codec import (
    TextQuery,
    fields,
    kept_tokens,
    query_text,
    text_list,
    text_route,
)

router = APIRouter(tags=["vllm"])
# vLLM's spellings of a score's two sides, in the order it reads them
SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
_COMMON = {"model", "use_activation", "truncate_prompt_tokens", "user"}
_SCORE = _COMMON | {name for pair in SIDES for name in pair}
_CLASSIFY = _COMMON | {"input"}
_ERRORS = error_docs(
    {
        400: "bad input (a field named), or a model of another task",
        401: "missing or invalid API key",
        404: "unknown model",
        413: "too many texts",
        429: "queue full; retry after Retry-After seconds",
        503: "model not loaded yet",
    },
    openai.ERROR_SCHEMA,
)
_USAGE = {
    "type": "object",
    "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}},
}
_TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_OPTIONS = {
    "model": {"type": "string"},
    "use_activation": {"type": "boolean", "default": True, "description": "false: the logits themselves"},
    "truncate_prompt_tokens": {
        "type": "integer",
        "minimum": -1,
        "nullable": True,
        "description": "-1 cuts at the model's length; k keeps a text's last k tokens (/classify)",
    },
}


def _answer(item: dict) -> dict:
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": {"type": "object", "properties": item}},
            "usage": _USAGE,
        },
    }


_SCORE_DOC = json_route_doc(
    ["text_1", "text_2"],
    {"text_1": _TEXTS, "text_2": _TEXTS, **_OPTIONS},
    {"text_1": "What is the capital of France?", "text_2": ["Paris is ...", "Berlin is ..."]},
    _answer({"index": {"type": "integer"}, "object": {"type": "string"}, "score": {"type": "number"}}),
    "each pair's score, in the order of the pairs",
    _ERRORS,
)
_CLASSIFY_DOC = json_route_doc(
    ["input"],
    {"input": _TEXTS, **_OPTIONS},
    {"input": ["I loved it.", "Never again."]},
    _answer(
        {
            "index": {"type": "integer"},
            "label": {"type": "string"},
            "probs": {"type": "array", "items": {"type": "number"}},
            "num_classes": {"type": "integer"},
        }
    ),
    "each input's label and probabilities",
    _ERRORS,
)


def _options(doc: dict, pairs: bool) -> dict:
    """The model, ``raw`` (use_activation false) and truncate_prompt_tokens as TextQuery's ``truncate`` (None: as
    --auto-truncate says) and ``max_tokens`` (a text's last k tokens, as /v1/embeddings keeps them; a pair's cut
    is the model's length alone)."""
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"model must be a string, got {quote(model)}")
    keep = kept_tokens(doc)
    if pairs and keep not in (None, -1):
        raise BadInput(
            f"truncate_prompt_tokens {keep} is not supported for pairs: -1 cuts each pair at the model's length"
        )
    return {
        "model": model,
        "raw": not json_bool(doc, "use_activation", "body", True),
        "truncate": None if keep is None else True,
        "max_tokens": None if keep in (None, -1) else keep,
    }


def _side(value: object, where: str, max_inputs: int) -> list[str]:
    return [query_text(value, where)] if isinstance(value, str) else text_list(value, where, max_inputs)


def read_score(doc: object, max_inputs: int) -> TextQuery:
    if not isinstance(doc, dict):
        raise BadInput(
            f"request body must be a JSON object with 'text_1' and 'text_2', got {type(doc).__name__}"
        )
    if unknown := sorted(set(doc) - _SCORE):
        raise BadInput(f"unknown field(s) {unknown}; expected {sorted(_SCORE)}")
    given = [pair for pair in SIDES if all(name in doc for name in pair)]
    if len(given) != 1:
        spellings = ", ".join(f"{a}/{b}" for a, b in SIDES)
        raise BadInput(f"a score needs its two sides once, as one of {spellings}; got {sorted(doc)}")
    (first, second), options = given[0], _options(doc, pairs=True)
    firsts, seconds = _side(doc[first], first, max_inputs), _side(doc[second], second, max_inputs)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise BadInput(
            f"{first} holds {len(firsts)} texts and {second} {len(seconds)}: one and N (1:N) or N and N (N:N)"
        )
    model, truncate, _ = options.pop("model"), options.pop("truncate"), options.pop("max_tokens")
    return TextQuery(model, firsts, truncate, options, field=second, seconds=seconds, tasks=("rerank",))


def read_classify(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _CLASSIFY, "input")
    options = _options(doc, pairs=False)
    inputs = text_inputs(doc["input"], "input", max_inputs)
    model, truncate, keep = options.pop("model"), options.pop("truncate"), options.pop("max_tokens")
    # truncate_prompt_tokens keeps a text's last tokens (vLLM's, as /v1/embeddings); else the end is cut
    side = "right" if truncate is None else "left"
    return TextQuery(
        model, inputs, truncate, options, tasks=("classify", "rerank"), direction=side, max_tokens=keep
    )


def _response(kind: str, req, model, data: list[dict]) -> bytes:
    return orjson.dumps(
        {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model.name,
            "data": data,
            "usage": {"prompt_tokens": req.tokens, "total_tokens": req.tokens, "completion_tokens": 0},
        }
    )


def write_score(req, model, outputs) -> bytes:
    values = scores(outputs, req.options["raw"])[:, 0]
    return _response(
        "score",
        req,
        model,
        [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(values)],
    )


def write_classify(req, model, outputs) -> bytes:
    labels = model.engine.manifest.label_names
    rows = scores(outputs, req.options["raw"])
    data = [
        {"index": i, "label": labels[int(np.argmax(row))], "probs": row.tolist(), "num_classes": len(row)}
        for i, row in enumerate(rows)
    ]
    return _response("classify", req, model, data)


for prefix in ("", "/v1"):
    text_route(
        router,
        f"{prefix}/score",
        "vllm",
        read_score,
        write_score,
        "Scores of text pairs (vLLM's API)",
        _SCORE_DOC,
    )
    text_route(
        router,
        f"{prefix}/classify",
        "vllm",
        read_classify,
        write_classify,
        "Labels and probabilities of texts (vLLM's API)",
        _CLASSIFY_DOC,
    )


MODEL_PREFIXES = ("/score", "/classify")  # /v1/score and /v1/classify are under the openai module's /v1/
ERROR_PATHS = ("/score", "/classify", "/v1/score", "/v1/classify")
PUBLIC_PATHS: tuple[str, ...] = ()
error_shape = openai.error_shape  # vLLM answers errors in OpenAI's error object
