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

``/pooling``: ``{"model", "input", "task", "use_activation": true, "dimensions", "truncate_prompt_tokens",
"encoding_format": "float" | "base64" | "bytes" | "bytes_only", "embed_dtype", "endianness"}`` ->
``{"id", "object": "list", "created", "model", "data": [{"index", "object": "pooling", "data"}], "usage"}``, what
vLLM's poolers give: ``token_embed`` (the default for an embedder) every token's last hidden state, special tokens
included, cut to ``dimensions`` and each normalized (``use_activation``); ``embed`` the sentence vector, normalized
likewise; ``classify`` (the default for a classifier or a cross-encoder) the probabilities; ``base64``, ``bytes``
and ``bytes_only`` as encodings.py writes them.

``/tokenize``: ``{"model", "prompt", "add_special_tokens": true, "return_token_strs": false}`` -> ``{"count",
"max_model_len", "tokens", "token_strs"}``: the whole text's token ids (a count over ``max_model_len`` says the model
would cut or refuse it). The path is TEI's /tokenize too (``inputs``): its route (tei.py) hands a body with
``prompt`` here, and errors on it are TEI's shape. ``/detokenize``: ``{"model", "tokens": [ids]}`` -> ``{"prompt"}``,
the tokenizer's decode with its special tokens and the model's clean-up of spaces, as vLLM's (transformers'
``decode``).
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from addnorm.model.tokenize import TooManyChars
from addnorm.service.core.inference import offload, work
from addnorm.service.core.text import scores, sentence_vectors, text_inputs, token_vectors
from addnorm.service.errors import BadInput, TooLarge, quote
from addnorm.service.guard import Known
from addnorm.service.protocols.common import (
    error_docs,
    json_bool,
    json_positive_int,
    json_route_doc,
    parse_json,
    read_body,
)
from addnorm.service.protocols.text import encodings, openai
from addnorm.service.protocols.text.codec import (
    TEXT_WORK,
    TOKEN_ROWS,
    Binary,
    TextQuery,
    fields,
    kept_tokens,
    query_text,
    text_front,
    text_list,
    text_route,
    token_ids,
)

router = APIRouter(tags=["vllm"])
# vLLM's spellings of a score's two sides, in the order it reads them
SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
_COMMON = {"model", "use_activation", "truncate_prompt_tokens", "user"}
_SCORE = _COMMON | {name for pair in SIDES for name in pair}
_CLASSIFY = _COMMON | {"input"}
_POOLING = (
    _COMMON
    | encodings.FIELDS
    | {
        "input",
        "task",
        "dimensions",
        "encoding_format",
        "normalize",  # older vLLM's name of use_activation
        "add_special_tokens",
    }
)
_FORMATS = ("float", "base64", *encodings.BYTES)
# vLLM's pooling tasks that a sentence-transformers embedder or a sequence classifier answers, by the models' tasks
POOLING_TASKS = {"token_embed": ("embed",), "embed": ("embed",), "classify": ("classify", "rerank")}
_TOKENIZE = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_DETOKENIZE = {"model", "tokens"}
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

TOKENIZE_DOC = json_route_doc(
    ["prompt"],
    {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "add_special_tokens": {"type": "boolean", "default": True},
        "return_token_strs": {"type": "boolean", "default": False},
    },
    {"prompt": "What is Deep Learning?"},
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True},
        },
    },
    "the text's token ids (and strings), vLLM's shape",
    _ERRORS,
)
_DETOKENIZE_DOC = json_route_doc(
    ["tokens"],
    {"model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
    {"tokens": [101, 7592, 2088, 102]},
    {"type": "object", "properties": {"prompt": {"type": "string"}}},
    "the ids' text, their special tokens kept",
    _ERRORS,
)
_VECTORS = {"type": "array", "items": {"type": "number"}}
_POOLING_DOC = encodings.with_bytes_answer(
    json_route_doc(
        ["input"],
        {
            "input": _TEXTS,
            **_OPTIONS,
            "task": {
                "type": "string",
                "enum": sorted(POOLING_TASKS),
                "nullable": True,
                "description": "default: token_embed for an embedder, classify for a classifier or a cross-encoder",
            },
            "dimensions": {"type": "integer", "minimum": 1, "nullable": True},
            "encoding_format": {
                "type": "string",
                "enum": list(_FORMATS),
                "default": "float",
                "description": encodings.BYTES_DOC,
            },
            **encodings.REQUEST_DOC,
            "normalize": {"type": "boolean", "nullable": True, "description": "older vLLM's use_activation"},
            "add_special_tokens": {"type": "boolean", "default": True, "enum": [True]},
        },
        {"input": ["What is Deep Learning?"], "task": "token_embed"},
        _answer(
            {
                "index": {"type": "integer"},
                "object": {"type": "string"},
                "data": {"oneOf": [{"type": "array", "items": _VECTORS}, _VECTORS, {"type": "string"}]},
            }
        ),
        "each input's pooled output: its tokens' vectors, its sentence vector or its probabilities",
        _ERRORS,
    )
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


def read_pooling(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _POOLING, "input")
    task = doc.get("task")
    if task is not None and (not isinstance(task, str) or task not in POOLING_TASKS):
        raise BadInput(
            f"task must be one of {sorted(POOLING_TASKS)} (or absent: the model's own), got {quote(task)}"
        )
    if (form := doc.get("encoding_format", "float")) not in _FORMATS:  # (a list or an object: in no tuple)
        raise BadInput(f"encoding_format must be one of {list(_FORMATS)}, got {quote(form)}")
    if not json_bool(doc, "add_special_tokens", "body", True):
        raise BadInput(
            "add_special_tokens false is not served: the model's vectors are of its texts with them"
        )
    if (normalize := json_bool(doc, "normalize", "body", None)) is not None:  # older vLLM's name of it
        if json_bool(doc, "use_activation", "body", None) not in (None, normalize):
            raise BadInput("normalize and use_activation disagree: give one")
        doc = {**doc, "use_activation": normalize}
    options = _options(doc, pairs=False)
    options["encoding"] = encodings.read_encoding(doc, form)
    options["dimensions"] = json_positive_int(doc, "dimensions")
    options["task"] = task
    inputs = text_inputs(doc["input"], "input", max_inputs)
    model, truncate, keep = options.pop("model"), options.pop("truncate"), options.pop("max_tokens")
    return TextQuery(
        model,
        inputs,
        truncate,
        options,
        tasks=("embed", "classify", "rerank") if task is None else POOLING_TASKS[task],
        token_rows=task in (None, "token_embed"),  # an embedder's (core: only where the model embeds)
        direction="right" if truncate is None else "left",
        max_tokens=keep,
    )


def write_pooling(req, model, outputs) -> bytes | Binary:
    """vLLM's poolers: each token's vector or the sentence's (cut to ``dimensions``, then normalized unless
    use_activation is false), or a classifier's probabilities (its logits unless use_activation); as JSON floats,
    base64 or the body's bytes (``encoding``)."""
    raw, dims = req.options["raw"], req.options["dimensions"]
    if req.options[TOKEN_ROWS]:
        data = [row.astype(np.float32, copy=False) for row in token_vectors(req, outputs, dims, not raw)]
    elif req.options["task"] == "embed":
        data = list(sentence_vectors(req, model, outputs, not raw, dims))
    else:
        data = list(scores(outputs, raw))
    encoding = req.options["encoding"]
    if encoding.as_body:
        return encodings.bytes_answer("pool", model.name, req.tokens, data, encoding)
    if encoding.form == "base64":  # each output's bytes, a token's vectors one after another
        data = [base64.b64encode(encodings.output_bytes(d, encoding)).decode() for d in data]
    items = [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(data)]
    return _response("pool", req, model, items)


def _response(kind: str, req, model, data: list[dict]) -> bytes:
    return orjson.dumps(
        {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model.name,
            "data": data,
            "usage": {"prompt_tokens": req.tokens, "total_tokens": req.tokens, "completion_tokens": 0},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,  # float32 rows: each value's shortest float32 form
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
text_route(
    router,
    "/pooling",
    "vllm",
    read_pooling,
    write_pooling,
    "Token vectors, sentence vectors or probabilities of texts (vLLM's pooling API)",
    _POOLING_DOC,
)


def tokenize_shape(doc: object) -> bool:
    """A /tokenize body in vLLM's shape (``prompt``, or a chat's ``messages``) rather than TEI's (``inputs``)."""
    return isinstance(doc, dict) and "inputs" not in doc and ("prompt" in doc or "messages" in doc)


async def tokenize(doc: dict, known: Known, amount: int) -> Response:
    """vLLM's /tokenize of a parsed body (tei.py's route reads it: the path is both APIs')."""
    if "messages" in doc:
        raise BadInput(
            "messages (a chat) needs a chat template, which an encoder has not: send the text as prompt"
        )
    doc = fields(doc, _TOKENIZE, "prompt")
    front = text_front(known, doc.get("model"))
    if not isinstance(text := doc["prompt"], str):
        raise BadInput(f"prompt must be a string, got {quote(text)}")
    special = json_bool(doc, "add_special_tokens", "body", True)
    strings = json_bool(doc, "return_token_strs", "body", False)
    try:
        front.tokenizer.within([text])
    except TooManyChars as exc:
        raise TooLarge(f"prompt has {exc.chars} characters, {exc.reason}: shorten it") from None
    (row,) = await offload(amount, front.tokenizer.tokens, [text], special)
    answer = {
        "count": len(row),
        "max_model_len": front.config.max_length,
        "tokens": [t[0] for t in row],
        "token_strs": [t[1] for t in row] if strings else None,
    }
    return Response(orjson.dumps(answer), media_type="application/json")


@router.post("/detokenize", summary="The text of token ids (vLLM's API)", openapi_extra=_DETOKENIZE_DOC)
async def detokenize(request: Request, known: Known) -> Response:
    """Read under the body limit as every route is (which bounds the ids); every id checked against the
    tokenizer's vocabulary; big work off the loop."""
    s = known.settings
    body = await read_body(request, s.max_body_bytes)
    amount = work(TEXT_WORK * len(body))
    doc = fields(await offload(amount, parse_json, body, s.max_elements), _DETOKENIZE, "tokens")
    tokenizer = text_front(known, doc.get("model"), "token ids").tokenizer
    answer = await offload(amount, _detokenized, doc["tokens"], tokenizer)
    return Response(answer, media_type="application/json")


def _detokenized(ids: object, tokenizer) -> bytes:
    row = token_ids(ids, "tokens", tokenizer.vocab_size)
    (text,) = tokenizer.decode([row], skip_special=False, clean_up=tokenizer.text.clean_up_spaces)
    return orjson.dumps({"prompt": text})


# /v1/score and /v1/classify are under the openai module's /v1/; /tokenize is TEI's too (tei.py names it)
MODEL_PREFIXES = ("/score", "/classify", "/pooling", "/detokenize")
ERROR_PATHS = ("/score", "/classify", "/v1/score", "/v1/classify", "/pooling", "/detokenize")
PUBLIC_PATHS: tuple[str, ...] = ()
error_shape = openai.error_shape  # vLLM answers errors in OpenAI's error object
