"""The simple JSON API for curl users: POST /v1/encode, GET /v1/model."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from addnorm.model.contract import EMBEDDINGS, ENCODED
from addnorm.service.core import inference
from addnorm.service.core.text import TextLimits
from addnorm.service.guard import Known
from addnorm.service.models.live_parity import judged
from addnorm.service.protocols.common import direct, error_docs, http_call, read_then_watch, timing_headers
from addnorm.service.protocols.v1 import codec, schema

router = APIRouter(prefix="/v1", tags=["v1"])

_ENCODE_DOC = {
    "parameters": schema.PARAMETERS,
    "requestBody": {
        "required": True,
        "content": {
            codec.JSON: {
                "schema": schema.REQUEST,
                "example": {EMBEDDINGS: [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]},
            },
            codec.OCTET: {
                "schema": {"type": "string", "format": "binary"},
                "description": "raw little-endian float32; shape in the X-Shape header, optional X-Lengths",
            },
            codec.NPY: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "the model's outputs as JSON by name (encoded, pooled, scores, sparse_weights: those it "
            "has, or the one ?output= names), their shape and the model; or one output in binary per the Accept "
            "header",
            "content": {
                codec.JSON: {
                    "schema": schema.ANSWER,
                    "example": {ENCODED: [[0.1, 0.2, 0.3]], "shape": [1, 3], "model": "encoder"},
                },
                codec.OCTET: {},
                codec.NPY: {},
            },
        },
        **error_docs(
            {
                400: "bad input",
                401: "missing or invalid API key",
                404: "unknown model",
                406: "no acceptable response media type",
                413: "request above the size limits",
                415: "unsupported Content-Type or Content-Encoding",
                429: "queue full; retry after Retry-After seconds",
                503: "model not loaded yet",
                504: "not answered within the request timeout",
            }
        ),
    },
}


@router.post("/encode", summary="Encode embeddings with the served encoder block", openapi_extra=_ENCODE_DOC)
@direct
async def encode(request: Request, known: Known) -> Response:
    """Decode by Content-Type, run, answer in the type Accept asks for."""
    start = time.perf_counter()
    settings, headers = known.settings, request.headers
    media = codec.negotiate(headers.get("accept"))
    named = request.query_params.get(codec.MODEL)
    output = codec.output_param(request.query_params.get(codec.OUTPUT))
    # The model is named in the payload (or ?model=), so reading and decoding count as its input stage.
    call = http_call(request, "v1", start)
    body = await read_then_watch(request, call, settings.max_body_bytes)
    request_codec = codec.EncodeCodec(
        headers.get("content-type", ""),
        headers,
        named,
        media,
        output,
        settings.max_elements,
        TextLimits.of(settings),
    )
    (payload, answer_headers), timings = await inference.run(known, call, request_codec, body)
    answer_headers.update(timing_headers(timings, time.perf_counter() - start))
    return Response(payload, media_type=media, headers=answer_headers)


@router.get(
    "/model",
    summary="A served model (the default, or ?model=NAME): manifest, providers in use",
    responses=error_docs(
        {401: "missing or invalid API key", 404: "unknown model", 503: "model not loaded yet"}
    ),
)
async def model(known: Known, model: str | None = None) -> dict:
    served = known.models.get(model)
    live = served.live_parity()
    if live is not None:
        live["judged"] = judged(served.engine.manifest)
    return {**served.describe(), "live_parity": live}


def examples(model: str, d_model: int) -> dict[tuple[str, str], dict]:
    """The request example for the served model (service/protocols/docs.py): two positions of its d_model."""
    return {("/v1/encode", "post"): {EMBEDDINGS: [[0.1] * d_model, [0.2] * d_model], "model": model}}


MODEL_PREFIXES = ("/v1/",)  # the guard checks everything under these prefixes
PUBLIC_PATHS: tuple[str, ...] = ()
