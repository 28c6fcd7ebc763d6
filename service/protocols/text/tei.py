"""text-embeddings-inference's API, so its clients switch by URL: ``POST /embed``, ``/embed_all``,
``/embed_sparse``, ``/similarity``, ``/tokenize``, ``/decode``, ``/rerank``, ``/predict``, ``GET /info`` and its
health probes ``GET /health`` and ``/ping``.

``/embed``: ``{"inputs": str | [str], "normalize": true, "truncate": false, "prompt_name": null, "dimensions":
null}`` -> ``[[float, ...], ...]``, one vector per input in input order. ``/tokenize``: ``{"inputs": str | [str],
"add_special_tokens": true}`` -> per input, its tokens as ``{"id", "text", "special", "start", "stop"}`` (given
vLLM's ``prompt`` instead, vLLM's /tokenize: vllm.py).
``/embed_all``: ``{"inputs", "truncate", "prompt_name"}`` -> per input, each of its tokens' vectors (the encoder's
last hidden state, special tokens included: late interaction). ``/similarity``: ``{"inputs": {"source_sentence":
str, "sentences": [str]}, "parameters": {"truncate", "truncation_direction", "prompt_name"}}`` -> each sentence's
cosine similarity to the source sentence, in input order. ``/decode``: ``{"ids": [int] | [[int]],
"skip_special_tokens": true}`` -> per id list, its text as the tokenizer's decoder joins it. ``/embed_sparse`` (a
SPLADE model): ``{"inputs", "truncate", "prompt_name"}`` -> per input, its non-zero weights as ``[{"index",
"value"}]``, indices ascending. ``/info``: the model, its kind and the limits.
``/rerank`` (a cross-encoder): ``{"query", "texts": [str], "raw_scores": false, "return_text": false, "truncate":
false}`` -> ``[{"index", "score", "text"?}]``, best first; each text scored with the query as a pair, cut (with
``truncate``) in the text, never the query; given ``documents`` instead of ``texts`` (vLLM's and Infinity's
/rerank), Jina's and Cohere's rerank (rerank.py), in and out. ``/predict`` (a classifier or a cross-encoder):
``{"inputs": str | [str, str] | [[str] | [str, str], ...], "raw_scores": false, "truncate": false}`` ->
``[{"label", "score"}]`` per input, best first (a list of them for a batch); scores are a softmax over the labels,
a sigmoid of one label, or the logits with ``raw_scores``. All on the default model (TEI serves one); errors are
TEI's ``{"error", "error_type"}``. ``/health`` and ``/ping`` answer 200 with no body once the models are loaded,
else 503 with ``{"error"}`` as ``/health/ready``: TEI's probes, public as the other probes are.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from addnorm import __version__
from addnorm.model.quantize import FLOAT
from addnorm.model.tokenize import TooManyChars
from addnorm.service.core.inference import offload, work
from addnorm.service.core.text import (
    EMBEDDING_TYPES,
    TextLimits,
    embedding_type,
    prompt_text,
    scores,
    sentence_vectors,
    sparse_rows,
    text_inputs,
    token_vectors,
)
from addnorm.service.errors import BadInput, TooLarge, quote
from addnorm.service.guard import Known
from addnorm.service.models.state import State
from addnorm.service.protocols.common import (
    error_docs,
    json_bool,
    json_positive_int,
    json_route_doc,
    parse_json,
    read_body,
)
from addnorm.service.protocols.text import rerank, vllm
from addnorm.service.protocols.text.codec import (
    TEXT_WORK,
    TextQuery,
    fields,
    query_text,
    text_front,
    text_list,
    text_route,
    token_ids,
)

router = APIRouter(tags=["tei"])
_EMBED = {
    "inputs",
    "normalize",
    "truncate",
    "truncation_direction",
    "prompt_name",
    "prompt",
    "dimensions",
    "embedding_type",
}
_TOKENIZE = {"inputs", "add_special_tokens", "prompt_name", "prompt"}
_EMBED_ALL = {"inputs", "truncate", "truncation_direction", "prompt_name", "prompt"}
_EMBED_SPARSE = _EMBED_ALL
_RERANK = {"query", "texts", "truncate", "truncation_direction", "raw_scores", "return_text"}
_PREDICT = {"inputs", "truncate", "truncation_direction", "raw_scores"}
_SIMILARITY = {"inputs", "parameters"}
_SIMILARITY_INPUTS = {"source_sentence", "sentences"}
_SIMILARITY_PARAMETERS = {"truncate", "truncation_direction", "prompt_name", "prompt"}
_DECODE = {"ids", "skip_special_tokens"}
_DOCUMENTS = "documents_shape"  # (a /rerank request's options: it came in Jina's and Cohere's shape)
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
# the options of TEI's text routes: where inputs over the model's length are cut, and the prompt put before each
_TRUNCATION = {
    "truncate": {"type": "boolean", "nullable": True, "description": "default: the server's --auto-truncate"},
    "truncation_direction": {"type": "string", "enum": ["Right", "Left"], "default": "Right"},
}
_PROMPTS = {
    "prompt_name": {"type": "string", "nullable": True},
    "prompt": {"type": "string", "nullable": True},
}


def _doc(properties: dict, answer: dict, example: dict, description: str = "one entry per input") -> dict:
    return json_route_doc(
        ["inputs"], {"inputs": _INPUTS, **properties}, example, answer, description, _ERRORS
    )


_EMBED_DOC = _doc(
    {
        "normalize": {"type": "boolean", "default": True},
        **_TRUNCATION,
        **_PROMPTS,
        "dimensions": {"type": "integer", "minimum": 1, "nullable": True},
        "embedding_type": {
            "type": "string",
            "enum": list(EMBEDDING_TYPES),
            "default": "float",
            "description": "float, or sentence-transformers' quantized forms (binary ones: 8 dimensions a byte)",
        },
    },
    {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    {"inputs": "What is Deep Learning?"},
)
_EMBED_ALL_DOC = _doc(
    {
        **_TRUNCATION,
        **_PROMPTS,
    },
    {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}},
    {"inputs": "What is Deep Learning?"},
    "per input, each of its tokens' vectors",
)
_SPARSE_VALUE = {
    "type": "object",
    "properties": {"index": {"type": "integer"}, "value": {"type": "number"}},
}
_EMBED_SPARSE_DOC = _doc(
    {
        **_TRUNCATION,
        **_PROMPTS,
    },
    {"type": "array", "items": {"type": "array", "items": _SPARSE_VALUE}},
    {"inputs": "What is Deep Learning?"},
    "per input, its non-zero vocabulary weights, indices ascending",
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
_TEI_TOKENIZE_DOC = _doc(
    {
        "add_special_tokens": {"type": "boolean", "default": True},
        **_PROMPTS,
    },
    {"type": "array", "items": {"type": "array", "items": _TOKEN}},
    {"inputs": "What is Deep Learning?"},
)
_SIMILARITY_DOC = json_route_doc(
    ["inputs"],
    {
        "inputs": {
            "type": "object",
            "required": ["source_sentence", "sentences"],
            "properties": {
                "source_sentence": {"type": "string"},
                "sentences": {"type": "array", "items": {"type": "string"}},
            },
        },
        "parameters": {
            "type": "object",
            "nullable": True,
            "properties": {
                **_TRUNCATION,
                **_PROMPTS,
            },
        },
    },
    {
        "inputs": {
            "source_sentence": "What is Deep Learning?",
            "sentences": ["Deep Learning is ...", "Paris is ..."],
        }
    },
    {"type": "array", "items": {"type": "number"}},
    "each sentence's cosine similarity to the source sentence, in input order",
    _ERRORS,
)
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_DECODE_DOC = json_route_doc(
    ["ids"],
    {
        "ids": {"oneOf": [_IDS, {"type": "array", "items": _IDS}]},
        "skip_special_tokens": {"type": "boolean", "default": True},
    },
    {"ids": [101, 7592, 2088, 102]},
    {"type": "array", "items": {"type": "string"}},
    "per id list, its text",
    _ERRORS,
)


_RANK = {
    "type": "object",
    "properties": {"index": {"type": "integer"}, "score": {"type": "number"}, "text": {"type": "string"}},
}
_PREDICTION = {"type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "number"}}}
_TEI_RERANK_DOC = json_route_doc(
    ["query", "texts"],
    {
        "query": {"type": "string"},
        "texts": {"type": "array", "items": {"type": "string"}},
        "raw_scores": {"type": "boolean", "default": False},
        "return_text": {"type": "boolean", "default": False},
        **_TRUNCATION,
    },
    {"query": "What is Deep Learning?", "texts": ["Deep Learning is ...", "Paris is ..."]},
    {"type": "array", "items": _RANK},
    "the texts by score, best first",
    _ERRORS,
)


def _either(ours: dict, other: dict, description: str) -> dict:
    """A route's OpenAPI entry (``json_route_doc``'s) that takes either API's body and answers in its shape; the
    errors in ``ours``'s shape, of the statuses either documents (the other's ``model`` field: a 404)."""
    body, answer = (
        [doc["requestBody"]["content"]["application/json"]["schema"] for doc in (ours, other)],
        [doc["responses"]["200"]["content"]["application/json"]["schema"] for doc in (ours, other)],
    )
    example = ours["requestBody"]["content"]["application/json"]["example"]
    shape = ours["responses"]["400"]["content"]
    theirs = {
        code: {"description": entry["description"], "content": shape}
        for code, entry in other["responses"].items()
        if code != "200" and code not in ours["responses"]
    }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"oneOf": body}, "example": example}},
        },
        "responses": {
            **ours["responses"],
            **theirs,
            "200": {
                "description": description,
                "content": {"application/json": {"schema": {"oneOf": answer}}},
            },
        },
    }


_RERANK_DOC = _either(
    _TEI_RERANK_DOC, rerank.DOC, "TEI's ranks for ``texts``; Jina's and Cohere's results for ``documents``"
)
_TOKENIZE_DOC = _either(
    _TEI_TOKENIZE_DOC, vllm.TOKENIZE_DOC, "TEI's tokens for ``inputs``; vLLM's ids and count for ``prompt``"
)
_ONE = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
_PREDICT_DOC = _doc(
    {
        "inputs": {"oneOf": [{"type": "string"}, _ONE, {"type": "array", "items": _ONE}]},
        "raw_scores": {"type": "boolean", "default": False},
        **_TRUNCATION,
    },
    {
        "oneOf": [
            {"type": "array", "items": _PREDICTION},
            {"type": "array", "items": {"type": "array", "items": _PREDICTION}},
        ]
    },
    {"inputs": "I like you. I love you."},
    "each input's labels by score, best first (a list of them for a batch)",
)


def _prompt(doc: dict) -> dict:
    """A request's prompt: ``prompt_name`` (one of the model's prompts) or ``prompt`` (a text of its own, as
    sentence-transformers' ``encode(prompt=...)``; not TEI's), as TextQuery's fields."""
    for field in ("prompt_name", "prompt"):
        if (value := doc.get(field)) is not None and not isinstance(value, str):
            raise BadInput(f"{field} must be a string, got {quote(value)}")
    return {"prompt": doc.get("prompt_name"), "prompt_text": doc.get("prompt")}


def _texts(doc: dict, max_inputs: int) -> list[str]:
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    if not isinstance(inputs[0], str):
        raise BadInput("inputs must be a string or a list of strings")
    return inputs


def read(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _EMBED, "inputs")
    dims = json_positive_int(doc, "dimensions")
    options = {"normalize": json_bool(doc, "normalize", "body", True), "dimensions": dims}
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    truncate = json_bool(doc, "truncate", "body", None)
    precision = embedding_type(doc.get("embedding_type"), "embedding_type")
    return TextQuery(
        None,
        inputs,
        truncate,
        options,
        field="inputs",
        direction=direction(doc),
        precisions=(precision,),
        **_prompt(doc),
    )


def direction(doc: dict) -> str:
    """TEI's ``truncation_direction``: ``Right`` (the default: an input's end is cut) or ``Left`` (its start)."""
    value = doc.get("truncation_direction", "Right")
    if value not in ("Right", "right", "Left", "left"):
        raise BadInput(
            f"truncation_direction must be 'Right' (an input's end is cut) or 'Left' (its start), got {quote(value)}"
        )
    return value.lower()


def read_rerank(doc: object, max_inputs: int) -> TextQuery:
    """TEI's rerank (``texts``), or with ``documents`` instead the shape vLLM and Infinity take on /rerank too
    (Jina's and Cohere's: rerank.py), answered in that shape."""
    if isinstance(doc, dict) and "documents" in doc and "texts" not in doc:
        query = rerank.read(doc, max_inputs)
        return dataclasses.replace(query, options={**query.options, _DOCUMENTS: True})
    doc = fields(doc, _RERANK, "query")
    query = query_text(doc["query"])
    if "texts" not in doc:
        raise BadInput("missing field 'texts'")
    texts = text_list(doc["texts"], "texts", max_inputs)
    options = {
        "raw": json_bool(doc, "raw_scores", "body", False),
        "texts": texts if json_bool(doc, "return_text", "body", False) else None,
    }
    truncate = json_bool(doc, "truncate", "body", None)
    return TextQuery(
        None,
        [query] * len(texts),
        truncate,
        options,
        field="texts",
        seconds=texts,
        tasks=("rerank",),
        direction=direction(doc),
    )


def write_rerank(req, model, outputs) -> bytes:
    if req.options.get(_DOCUMENTS):
        return rerank.write(req, model, outputs)
    score = scores(outputs, req.options["raw"])[:, 0]
    texts = req.options["texts"]
    ranks = [
        {"index": int(i), "score": float(score[i]), **({"text": texts[i]} if texts is not None else {})}
        for i in np.argsort(-score, kind="stable")
    ]
    return orjson.dumps(ranks)


def _sequences(value: object, max_inputs: int) -> tuple[list[str], list[str] | None, bool]:
    """TEI's predict inputs: a text, a pair [text, text], or a batch of [text] or [text, text] (all of one kind
    here) -> (firsts, seconds or None, whether it was a batch)."""
    if isinstance(value, str):
        return [query_text(value, "inputs")], None, False
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if len(value) > 2:
            raise BadInput(
                "inputs is a text, a pair [text, text], or a batch [[text], [text, text], ...]; got a list of "
                f"{len(value)} strings (a batch of texts is [[text], [text], ...])"
            )
        texts = [query_text(v, f"inputs[{i}]") for i, v in enumerate(value)]
        return texts[:1], texts[1:] or None, False
    if not isinstance(value, list) or not value:
        raise BadInput("inputs must be a text, a pair [text, text], or a non-empty batch of them")
    if len(value) > max_inputs:
        raise TooLarge(
            f"inputs holds {len(value)} inputs, more than this server's {max_inputs} (ADDNORM_MAX_CLIENT_BATCH_SIZE)"
        )
    for i, v in enumerate(value):
        if not isinstance(v, list) or len(v) not in (1, 2):
            raise BadInput(f"inputs[{i}] must be [text] or [text, text], got {quote(v)}")
        for j, t in enumerate(v):
            query_text(t, f"inputs[{i}][{j}]")
    if len({len(v) for v in value}) > 1:
        raise BadInput("inputs mixes single texts and pairs: send them in two requests")
    return [v[0] for v in value], ([v[1] for v in value] if len(value[0]) == 2 else None), True


def read_predict(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _PREDICT, "inputs")
    firsts, seconds, batch = _sequences(doc["inputs"], max_inputs)
    options = {"raw": json_bool(doc, "raw_scores", "body", False), "batch": batch}
    truncate = json_bool(doc, "truncate", "body", None)
    return TextQuery(
        None,
        firsts,
        truncate,
        options,
        field="inputs",
        seconds=seconds,
        tasks=("classify", "rerank"),
        direction=direction(doc),
    )


def write_predict(req, model, outputs) -> bytes:
    labels = model.engine.manifest.label_names
    rows = [
        [{"score": float(row[i]), "label": labels[i]} for i in np.argsort(-row, kind="stable")]
        for row in scores(outputs, req.options["raw"])
    ]
    return orjson.dumps(rows if req.options["batch"] else rows[0])


def read_similarity(doc: object, max_inputs: int) -> TextQuery:
    """TEI's sentence similarity: the source sentence and the others embedded in one request (TEI counts the
    source against the batch limit too), its options under ``parameters``."""
    doc = fields(doc, _SIMILARITY, "inputs")
    inputs = doc["inputs"]
    if not isinstance(inputs, dict):
        raise BadInput(f"inputs must be an object {{source_sentence, sentences}}, got {quote(inputs)}")
    if unknown := sorted(set(inputs) - _SIMILARITY_INPUTS):
        raise BadInput(f"unknown field(s) {unknown} in inputs; expected {sorted(_SIMILARITY_INPUTS)}")
    source = query_text(inputs.get("source_sentence"), "inputs.source_sentence")
    sentences = inputs.get("sentences")
    if isinstance(sentences, list) and len(sentences) + 1 > max_inputs:
        raise TooLarge(
            f"inputs.sentences holds {len(sentences)} texts: with the source sentence more than this server's "
            f"{max_inputs} (ADDNORM_MAX_CLIENT_BATCH_SIZE)"
        )
    sentences = text_list(sentences, "inputs.sentences", max_inputs)
    params = doc.get("parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadInput(f"parameters must be an object, got {quote(params)}")
    if unknown := sorted(set(params) - _SIMILARITY_PARAMETERS):
        raise BadInput(f"unknown field(s) {unknown} in parameters; expected {sorted(_SIMILARITY_PARAMETERS)}")
    return TextQuery(
        None,
        [source, *sentences],
        json_bool(params, "truncate", "parameters", None),
        {},
        field=lambda i: "inputs.source_sentence" if i == 0 else f"inputs.sentences[{i - 1}]",
        direction=direction(params),
        **_prompt(params),
    )


def write_similarity(req, model, outputs) -> bytes:
    vectors = sentence_vectors(req, model, outputs, normalize=True, precision=FLOAT).astype(np.float64)
    # written as TEI writes its f32s: each value's shortest float32 form
    cosines = (vectors[1:] @ vectors[0]).astype(np.float32)
    return orjson.dumps(cosines, option=orjson.OPT_SERIALIZE_NUMPY)


def read_embed_all(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _EMBED_ALL, "inputs")
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    truncate = json_bool(doc, "truncate", "body", None)
    return TextQuery(
        None, inputs, truncate, {}, field="inputs", token_rows=True, direction=direction(doc), **_prompt(doc)
    )


def write_embed_all(req, model, outputs) -> bytes:
    return orjson.dumps(token_vectors(req, outputs), option=orjson.OPT_SERIALIZE_NUMPY)


def read_embed_sparse(doc: object, max_inputs: int) -> TextQuery:
    doc = fields(doc, _EMBED_SPARSE, "inputs")
    inputs = text_inputs(doc["inputs"], "inputs", max_inputs)
    truncate = json_bool(doc, "truncate", "body", None)
    return TextQuery(
        None,
        inputs,
        truncate,
        {},
        field="inputs",
        tasks=("sparse",),
        direction=direction(doc),
        **_prompt(doc),
    )


def write_embed_sparse(req, model, outputs) -> bytes:
    return orjson.dumps(
        [
            [{"index": int(i), "value": float(v)} for i, v in zip(index, values, strict=True)]
            for index, values in sparse_rows(outputs)
        ]
    )


def write(req, model, outputs) -> bytes:
    out = sentence_vectors(req, model, outputs, req.options["normalize"], req.options["dimensions"])
    return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


text_route(
    router, "/embed", "tei", read, write, "Embeddings of texts (text-embeddings-inference's API)", _EMBED_DOC
)
text_route(
    router,
    "/embed_all",
    "tei",
    read_embed_all,
    write_embed_all,
    "Every token's vector of texts (text-embeddings-inference's API)",
    _EMBED_ALL_DOC,
)

text_route(
    router,
    "/embed_sparse",
    "tei",
    read_embed_sparse,
    write_embed_sparse,
    "SPLADE's sparse vectors of texts (text-embeddings-inference's API)",
    _EMBED_SPARSE_DOC,
)
text_route(
    router,
    "/similarity",
    "tei",
    read_similarity,
    write_similarity,
    "Cosine similarity of sentences to a source sentence (text-embeddings-inference's API)",
    _SIMILARITY_DOC,
)


@router.get("/info", summary="The served model and the server's limits (text-embeddings-inference's API)")
async def info(known: Known) -> dict:
    """What TEI's clients read first: the model, its kind (an embedder's pooling, a classifier's or a reranker's
    labels), its longest input, and the batching limits."""
    model = known.models.get(None)
    manifest, s = model.engine.manifest, known.settings
    config = manifest.config
    if config.task in ("embed", "sparse"):
        pooled = (
            "splade" if config.task == "sparse" else config.pooling if config.pooling != "none" else "mean"
        )
        kind = {"embedding": {"pooling": pooled}}
    else:
        labels = manifest.label_names
        kind = {
            ("reranker" if config.task == "rerank" else "classifier"): {
                "id2label": {str(i): name for i, name in enumerate(labels)},
                "label2id": {name: i for i, name in enumerate(labels)},
            }
        }
    front = model.engine.text
    return {
        "model_id": model.name,
        "model_sha": manifest.model_sha256,
        "model_dtype": "float16" if manifest.variant == "fp16" else "float32",
        "served_model_name": model.name,
        "model_type": kind,
        "prompts": dict(front.config.prompts) if front is not None else {},
        "max_concurrent_requests": s.max_queue_size,
        "max_input_length": front.config.max_length if front is not None else None,
        "max_batch_tokens": s.max_batch_tokens,
        "max_batch_requests": s.max_batch_size,
        "max_client_batch_size": s.max_client_batch_size,
        "auto_truncate": s.auto_truncate,
        "tokenization_workers": 1,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


text_route(
    router,
    "/rerank",
    "tei",
    read_rerank,
    write_rerank,
    "A query's texts ranked by a cross-encoder (text-embeddings-inference's API)",
    _RERANK_DOC,
)
text_route(
    router,
    "/predict",
    "tei",
    read_predict,
    write_predict,
    "Labels of texts or pairs by a classifier (text-embeddings-inference's API)",
    _PREDICT_DOC,
)


@router.post(
    "/tokenize", summary="Tokens of texts (text-embeddings-inference's API)", openapi_extra=_TOKENIZE_DOC
)
async def tokenize(request: Request, known: Known) -> Response:
    """Read under the body limit as every route is; each text within the model's characters before it is
    tokenized; the answer at most as many tokens as /embed could take in one request; big work off the loop."""
    s = known.settings
    body = await read_body(request, s.max_body_bytes)
    amount = work(TEXT_WORK * len(body))
    doc = await offload(amount, parse_json, body, s.max_elements)
    if vllm.tokenize_shape(doc):  # vLLM's body (``prompt``) on the same path: answered in vLLM's shape
        return await vllm.tokenize(doc, known, amount)
    doc = fields(doc, _TOKENIZE, "inputs")
    front = text_front(known, None)
    prompt = _prompt(doc)
    prefix = prompt_text(front, prompt["prompt"], prompt["prompt_text"], TextLimits.of(s))
    texts = [prefix + text for text in _texts(doc, s.max_client_batch_size)]
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


@router.post(
    "/decode", summary="Texts of token ids (text-embeddings-inference's API)", openapi_extra=_DECODE_DOC
)
async def decode(request: Request, known: Known) -> Response:
    """Read under the body limit as every route is (which bounds the ids); every id checked against the
    tokenizer's vocabulary (tokenizers drops an unknown one without a word); big work off the loop."""
    s = known.settings
    body = await read_body(request, s.max_body_bytes)
    amount = work(TEXT_WORK * len(body))
    doc = fields(await offload(amount, parse_json, body, s.max_elements), _DECODE, "ids")
    front = text_front(known, None, "token ids")
    special = json_bool(doc, "skip_special_tokens", "body", True)
    answer = await offload(amount, _decoded, doc["ids"], s.max_client_batch_size, front.tokenizer, special)
    return Response(answer, media_type="application/json")


def _decoded(ids: object, max_inputs: int, tokenizer, special: bool) -> bytes:
    return orjson.dumps(tokenizer.decode(_id_lists(ids, max_inputs, tokenizer.vocab_size), special))


def _id_lists(value: object, max_inputs: int, vocab: int) -> list[list[int]]:
    """TEI's ``ids``: one list of token ids, or a batch of them -> the lists (TEI answers a list of texts for
    both)."""
    if not isinstance(value, list):
        raise BadInput(f"ids must be a list of token ids or a list of such lists, got {quote(value)}")
    batch = bool(value) and all(isinstance(v, list) for v in value)
    rows = value if batch else [value]
    if len(rows) > max_inputs:
        raise TooLarge(
            f"ids holds {len(rows)} id lists, more than this server's {max_inputs} (ADDNORM_MAX_CLIENT_BATCH_SIZE)"
        )
    return [token_ids(row, f"ids[{i}]" if batch else "ids", vocab) for i, row in enumerate(rows)]


async def _health(state: State) -> Response:
    """TEI's probe: 200 and no body once every model is loaded, else 503 with the reason, as /health/ready says it
    (a probe reads the status only)."""
    if (reason := state.not_ready_reason()) is None:
        return Response(status_code=200)
    return JSONResponse({"error": reason}, status_code=503, headers={"Retry-After": "1"})


_PROBE = {503: {"description": "still loading, or failed to load", "content": {"application/json": {}}}}
for path, summary in (("/health", "probe"), ("/ping", "SageMaker probe")):
    router.add_api_route(
        path,
        _health,
        methods=["GET"],
        name=f"tei_{path.strip('/')}",
        summary=f"Ready (text-embeddings-inference's {summary}): 200 with no body",
        response_class=Response,  # no body: not JSON
        responses=_PROBE,
    )


MODEL_PREFIXES = ("/embed", "/similarity", "/tokenize", "/decode", "/rerank", "/predict", "/info")
ERROR_PATHS = MODEL_PREFIXES


def error_shape(status: int, message: str) -> dict:
    """text-embeddings-inference's ``{"error", "error_type"}`` (its ErrorType: validation, overloaded, unhealthy,
    backend)."""
    kind = {429: "overloaded", 503: "unhealthy"}.get(status, "backend" if status >= 500 else "validation")
    return {"error": message, "error_type": kind}


PUBLIC_PATHS = ("/health", "/ping")
