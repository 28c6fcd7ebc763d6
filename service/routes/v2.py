"""The Open Inference Protocol (V2) over HTTP, with the binary tensor data extension (tritonclient works as is)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from service import codec_v2
from service.errors import NotFound, Unavailable
from service.http import infer, offload, read_body, timing_headers
from service.state import ReadyState, ServiceState, State

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])

_ERRORS = {
    400: {"description": 'bad request: {"error": "..."}'},
    404: {"description": "unknown model or version"},
    503: {"description": "model not loaded yet"},
}
_INFER_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"type": "object", "required": ["inputs"]},
                "example": {
                    "id": "42",
                    "inputs": [
                        {
                            "name": "embeddings",
                            "shape": [1, 2, 3],
                            "datatype": "FP32",
                            "data": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                        }
                    ],
                    "outputs": [{"name": "encoded", "parameters": {"binary_data": False}}],
                },
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor extension: JSON header of Inference-Header-Content-Length bytes, "
                "then the raw tensors of the inputs that set parameters.binary_data_size, in order",
            },
        },
    },
    "responses": {
        "200": {
            "description": "V2 inference response; with binary outputs, a JSON header of "
            "Inference-Header-Content-Length bytes followed by the raw output tensors",
            "content": {"application/json": {}, "application/octet-stream": {}},
        },
        **{str(k): v for k, v in _ERRORS.items()},
        "413": {"description": "request above the size limits"},
        "429": {"description": "queue full"},
        "504": {"description": "not answered in time"},
    },
}


def _model(state: ServiceState, name: str, version: str | None) -> ServiceState:
    """404 for an unknown model or version, 503 while loading."""
    if not state.ready:
        raise Unavailable(state.not_ready_message(), headers={"Retry-After": "1"})
    assert state.engine is not None
    if name != state.engine.name:
        raise NotFound(f"unknown model {name!r}; this server serves {state.engine.name!r}")
    if version not in (None, "", codec_v2.VERSION):
        raise NotFound(f"unknown version {version!r} of model {name!r}; available: [{codec_v2.VERSION!r}]")
    return state


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": "addnorm", "version": "0.1.0", "extensions": codec_v2.EXTENSIONS}


@router.get("/health/live", summary="Server liveness")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", summary="Server readiness (503 until the model is loaded)", responses=_ERRORS)
async def ready(state: State) -> Response:
    if not state.ready:
        return JSONResponse({"error": state.not_ready_message()}, status_code=503)
    return JSONResponse({"ready": True})


@router.get("/models/{name}", summary="Model metadata", responses=_ERRORS)
@router.get("/models/{name}/versions/{version}", summary="Model metadata (one version)", responses=_ERRORS)
async def model_metadata(name: str, state: State, version: str | None = None) -> dict:
    state = _model(state, name, version)
    assert state.engine is not None
    return codec_v2.model_metadata(state.engine.manifest)


@router.get("/models/{name}/ready", summary="Model readiness", responses=_ERRORS)
@router.get(
    "/models/{name}/versions/{version}/ready", summary="Model readiness (one version)", responses=_ERRORS
)
async def model_ready(name: str, state: State, version: str | None = None) -> dict:
    _model(state, name, version)
    return {"name": name, "ready": True}


@router.post("/models/{name}/infer", summary="Inference", openapi_extra=_INFER_DOC)
@router.post(
    "/models/{name}/versions/{version}/infer", summary="Inference (one version)", openapi_extra=_INFER_DOC
)
async def model_infer(name: str, request: Request, state: ReadyState, version: str | None = None) -> Response:
    start = time.perf_counter()
    state = _model(state, name, version)
    assert state.engine is not None
    settings = state.settings
    body = await read_body(request, settings.max_body_bytes)
    req = await offload(len(body), _decode, request, body, state)
    out, timings = await infer(request, state, req.embeddings, req.mask, req.timeout_s)
    payload, headers = await offload(out.nbytes, codec_v2.encode_infer, req, state.engine.name, out)
    headers.update(timing_headers(timings, time.perf_counter() - start))
    return Response(payload, headers=headers, media_type=headers.pop("Content-Type"))


def _decode(request: Request, body: bytes, state: ServiceState) -> codec_v2.InferRequest:
    assert state.engine is not None
    body = codec_v2.decompress(body, request.headers.get("content-encoding"), state.settings.max_body_bytes)
    return codec_v2.decode_infer(
        body, request.headers.get(codec_v2.HEADER_LENGTH), state.engine.manifest, state.settings.max_elements
    )
