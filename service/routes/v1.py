"""The simple JSON API for curl users: POST /v1/encode, GET /v1/model."""

from __future__ import annotations

import time

import numpy as np
from fastapi import APIRouter, Request, Response

from service import codec_v1
from service.http import infer, offload, read_body, timing_headers
from service.state import ReadyState

router = APIRouter(prefix="/v1", tags=["v1"])

_ENCODE_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["embeddings"],
                    "properties": {
                        "embeddings": {
                            "description": "[seq, d_model], [batch, seq, d_model], or a list of [seq_i, d_model] "
                            "sequences of different lengths (padded and masked by the server)",
                            "type": "array",
                            "items": {"type": "array"},
                        },
                        "mask": {
                            "description": "optional [seq] or [batch, seq] booleans, true = padding",
                            "type": "array",
                            "items": {},
                        },
                    },
                },
                "example": {"embeddings": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]},
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "raw little-endian float32; shape in the X-Shape header, optional X-Lengths",
            },
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "encoded tensor as JSON {encoded, shape, model}, or binary per the Accept header",
            "content": {
                "application/json": {
                    "example": {"encoded": [[0.1, 0.2, 0.3]], "shape": [1, 3], "model": "encoder"}
                },
                "application/octet-stream": {},
                "application/x-npy": {},
            },
        },
        "400": {"description": 'bad input: {"error": "..."}'},
        "413": {"description": "request above the size limits"},
        "429": {"description": "queue full; retry after Retry-After seconds"},
        "503": {"description": "model not loaded yet"},
        "504": {"description": "not answered within the request timeout"},
    },
}


@router.post("/encode", summary="Encode embeddings with the served encoder block", openapi_extra=_ENCODE_DOC)
async def encode(request: Request, state: ReadyState) -> Response:
    start = time.perf_counter()
    assert state.engine is not None
    settings = state.settings
    media = codec_v1.negotiate(request.headers.get("accept"))
    body = await read_body(request, settings.max_body_bytes)
    req = await offload(
        len(body),
        codec_v1.decode, request.headers.get("content-type", ""), body, request.headers,
        state.engine.d_model, settings.max_elements,
    )  # fmt: skip
    out, timings = await infer(request, state, req.embeddings, req.mask)
    result = req.split(out)
    if media == codec_v1.JSON:
        payload = await offload(out.nbytes * 3, codec_v1.encode_json, result, state.engine.name)
        headers = {}
    else:
        tensor = result if isinstance(result, np.ndarray) else out  # ragged: padded tensor + lengths
        payload = codec_v1.encode_binary(tensor, media)
        headers = {"X-Shape": ",".join(map(str, tensor.shape))}
        if req.lengths is not None:
            headers["X-Lengths"] = ",".join(map(str, req.lengths))
    headers.update(timing_headers(timings, time.perf_counter() - start))
    return Response(payload, media_type=media, headers=headers)


@router.get("/model", summary="The served model: manifest, providers in use")
async def model(state: ReadyState) -> dict:
    assert state.engine is not None
    return state.engine.describe()
