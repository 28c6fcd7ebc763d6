"""One codec and one route body for the text APIs: a protocol gives how its JSON names the model, the inputs and
its options (``read``), and how it writes the vectors (``write``); ``answer`` serves them; tokenizing, parts and
pooling are the core's (service/core/text.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response

from addnorm.model.quantize import FLOAT
from addnorm.service.core import inference
from addnorm.service.core.inference import work
from addnorm.service.core.text import (
    PRECISION,
    TextLimits,
    TextRequest,
    decode_texts,
    need_precision,
    need_task,
)
from addnorm.service.errors import BadInput, TooLarge, quote
from addnorm.service.guard import Known
from addnorm.service.protocols.common import direct, http_call, parse_json, read_then_watch, timing_headers

if TYPE_CHECKING:
    from addnorm.service.batching.merging import Outputs
    from addnorm.service.core.inference import Resolve
    from addnorm.service.models.registry import ServingModel

# Tokenizing and embedding cost about as much per byte of text as parsing JSON does per byte: counted 8x, a
# request of more than 32 KB of text leaves the event loop.
TEXT_WORK = 8
TOKEN_ROWS = "token_rows"  # (the request's options: its answer writes every token's vector)


@dataclass(frozen=True)
class TextQuery:
    """What a text API's JSON asks: the model (None: the default), its inputs (texts or token id lists), whether
    to cut inputs over the model's length, and the protocol's own options for ``write``; ``seconds``: each input's
    second text, the two scored as a pair (a query and a document); ``tasks``: the models' tasks that answer it
    (EncoderConfig.task)."""

    model: str | None
    inputs: list
    truncate: bool | None  # None: as the server's --auto-truncate says
    options: dict
    prompt: str | None = None  # one of the model's named prompts, put before each text
    prompt_names: tuple[str, ...] = ()  # or the first of these the model has (else its default: no error)
    prompt_text: str | None = None  # or a text of the request's own, put before each text
    # what the API calls its inputs in errors (TEI: "inputs"), or each input's name by its index
    field: str | Callable[[int], str] = "input"
    seconds: list[str] | None = None
    tasks: tuple[str, ...] = ("embed",)
    token_rows: bool = False  # the answer writes every token's vector, not one a text (TEI's /embed_all)
    direction: str = "right"  # where truncation cuts: the end of an input (right) or its start (left)
    # the request's own limit on each text's tokens, below the model's (Cohere's); a pair's: its second text's own
    max_tokens: int | None = None
    # the sentence vectors' forms: float32 or quantized ones (core/text.py, EMBEDDING_TYPES); the first is the
    # answer's, a protocol that writes several (Cohere's embedding_types) asks for each
    precisions: tuple[str, ...] = (FLOAT,)
    precision_field: str = "embedding_type"  # what the API calls it, in error messages


@dataclass(frozen=True)
class Binary:
    """An answer that is not JSON (vLLM's ``encoding_format: bytes``): its body, media type and own headers."""

    body: bytes
    media_type: str
    headers: dict[str, str]


@dataclass
class TextCodec:
    """A text API's codec for one request (service.core.inference.Codec)."""

    read: Callable[[object, int], TextQuery]  # (parsed JSON, max inputs) -> TextQuery
    write: Callable[[TextRequest, ServingModel, Outputs], bytes | Binary]  # bytes: JSON
    max_elements: int
    limits: TextLimits
    route: str = ""  # the path asked, in a refusal for another task's model

    def decode_work(self, body: bytes) -> int:
        return work(TEXT_WORK * len(body))

    def encode_work(self, req: TextRequest, nbytes: int) -> int:
        # pooled vectors: a small share of the outputs' bytes; token vectors: about all of them
        return work(nbytes if req.options.get(TOKEN_ROWS) else nbytes // 8)

    def decode(self, body: bytes, resolve: Resolve) -> TextRequest:
        limits = self.limits
        read = self.read(parse_json(body, self.max_elements), limits.max_inputs)
        model = resolve(read.model)
        need_task(model, read.tasks, self.route)
        for precision in read.precisions:
            need_precision(model, precision, read.precision_field)
        prompt = read.prompt
        if read.prompt_names and model.engine.text is not None:
            prompts = model.engine.text.config.prompts
            prompt = next((name for name in read.prompt_names if name in prompts), None)
        req = decode_texts(
            model,
            read.inputs,
            read.truncate,
            limits,
            read.field,
            prompt,
            read.seconds,
            read.prompt_text,
            read.direction,
            read.max_tokens,
        )
        req.model = read.model
        # every token's vector: an embedder's (vLLM's /pooling asks any model; a classifier answers its scores)
        token_rows = read.token_rows and model.engine.manifest.config.task == "embed"
        req.options = {**read.options, TOKEN_ROWS: token_rows, PRECISION: read.precisions[0]}
        if token_rows and (values := req.tokens * model.engine.d_model) > self.max_elements:
            raise TooLarge(
                f"{read.field} hold {req.tokens} tokens: {values} values of token vectors, more than this server "
                f"answers at once ({self.max_elements}: ADDNORM_MAX_ELEMENTS); split the request"
            )
        return req

    def encode(self, req: TextRequest, model: ServingModel, outputs: Outputs) -> bytes | Binary:
        return self.write(req, model, outputs)


async def answer(request: Request, known: Known, protocol: str, read: Callable, write: Callable) -> Response:
    """A text API's route: the body read under the limits, the request core's text step run with this API's
    ``read`` and ``write``, the answer (JSON, or ``write``'s ``Binary``) with its timing headers."""
    start = time.perf_counter()
    s = known.settings
    call = http_call(request, protocol, start)
    body = await read_then_watch(request, call, s.max_body_bytes)
    text_codec = TextCodec(read, write, s.max_elements, TextLimits.of(s), request.scope["path"])
    payload, timings = await inference.run(known, call, text_codec, body)
    headers = timing_headers(timings, time.perf_counter() - start)
    if isinstance(payload, Binary):
        return Response(payload.body, media_type=payload.media_type, headers={**payload.headers, **headers})
    return Response(payload, media_type="application/json", headers=headers)


def text_route(
    router: APIRouter, path: str, protocol: str, read: Callable, write: Callable, summary: str, doc: dict
) -> None:
    """A text API's route: ``POST path`` on ``router``, its body read and answered by ``answer`` with this API's
    ``read`` and ``write``; ``summary`` and ``doc`` (its ``openapi_extra``) are its OpenAPI entry."""

    @direct
    async def route(request: Request, known: Known) -> Response:
        return await answer(request, known, protocol, read, write)

    name = path.strip("/").replace("/", "_")
    router.add_api_route(path, route, methods=["POST"], name=name, summary=summary, openapi_extra=doc)


def kept_tokens(doc: dict) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: None (absent), -1 (cut at the model's length) or k (keep k tokens)."""
    keep = doc.get("truncate_prompt_tokens")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or keep == 0):
        raise BadInput(
            f"truncate_prompt_tokens must be -1 (the model's length) or a positive integer, got {quote(keep)}"
        )
    return keep


def fields(doc: object, known: set[str], required: str) -> dict:
    if not isinstance(doc, dict):
        raise BadInput(f"request body must be a JSON object with {required!r}, got {type(doc).__name__}")
    if unknown := sorted(set(doc) - known):
        raise BadInput(f"unknown field(s) {unknown}; expected {sorted(known)}")
    if required not in doc:
        raise BadInput(f"missing field {required!r}")
    return doc


def text_list(value: object, where: str, max_inputs: int) -> list[str]:
    """A JSON list of non-empty strings, at most ``max_inputs`` (the documents of a rerank)."""
    if not isinstance(value, list) or not value:
        raise BadInput(f"{where} must be a non-empty list of strings")
    if len(value) > max_inputs:
        raise TooLarge(
            f"{where} holds {len(value)} texts, more than this server's {max_inputs} (ADDNORM_MAX_CLIENT_BATCH_SIZE)"
        )
    for i, v in enumerate(value):
        if not isinstance(v, str) or not v:
            raise BadInput(f"{where}[{i}] must be a non-empty string, got {quote(v)}")
    return value


def query_text(value: object, where: str = "query") -> str:
    """A JSON non-empty string (a query, a text of a pair)."""
    if not isinstance(value, str) or not value:
        raise BadInput(f"{where} must be a non-empty string, got {quote(value)}")
    return value


def text_front(known: Known, model: str | None, wants: str = "text"):
    """The named model's text front (its tokenizer and limits); a model served from embeddings has none."""
    if model is not None and not isinstance(model, str):
        raise BadInput(f"model must be a string, got {quote(model)}")
    serving = known.models.get(model)
    if serving.engine.text is None:
        raise BadInput(
            f"model {quote(serving.name)} takes embeddings, not {wants}: export it with --inputs ids"
        )
    return serving.engine.text


def token_ids(row: object, where: str, vocab: int) -> list[int]:
    """A JSON list of token ids, each below ``vocab`` (tokenizers' decode drops an unknown id without a word):
    checked at C speed, the culprit looked for only on a refusal."""
    if not isinstance(row, list):
        raise BadInput(f"{where} must be a list of token ids, got {quote(row)}")
    if all(type(t) is int for t in row) and (not row or (min(row) >= 0 and max(row) < vocab)):
        return row
    j, t = next((j, t) for j, t in enumerate(row) if type(t) is not int or not 0 <= t < vocab)
    if type(t) is not int:
        raise BadInput(f"{where}[{j}] must be a token id (an integer), got {quote(t)}")
    raise BadInput(f"{where}[{j}] is token id {t}, outside this model's vocabulary [0, {vocab})")
