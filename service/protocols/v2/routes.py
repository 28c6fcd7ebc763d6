"""The Open Inference Protocol (V2) over HTTP, with the binary tensor data extension (tritonclient works as is)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from addnorm import __version__ as VERSION
from addnorm.model.contract import EMBEDDINGS, ENCODED
from addnorm.service.core import inference
from addnorm.service.core.text import TextLimits
from addnorm.service.errors import BadInput
from addnorm.service.guard import Known
from addnorm.service.models.control import check_parameters
from addnorm.service.models.registry import ServingModel
from addnorm.service.models.state import KnownModels, State
from addnorm.service.protocols.common import (
    direct,
    error_docs,
    http_call,
    parse_json,
    read_body,
    read_then_watch,
    timing_headers,
)
from addnorm.service.protocols.v2 import codec, metadata, schema

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])

_ERRORS = error_docs(
    {401: "missing or invalid API key", 404: "unknown model or version", 503: "model not loaded yet"}
)
_INFER_DOC = {
    "parameters": schema.PARAMETERS,
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": schema.REQUEST,
                "example": {
                    "id": "42",
                    "inputs": [
                        {
                            "name": EMBEDDINGS,
                            "shape": [1, 2, 3],
                            "datatype": "FP32",
                            "data": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                        }
                    ],
                    "outputs": [{"name": ENCODED, "parameters": {"binary_data": False}}],
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
            "content": {"application/json": {"schema": schema.ANSWER}, "application/octet-stream": {}},
        },
        **error_docs(
            {
                400: "bad request",
                401: "missing or invalid API key",
                404: "unknown model or version",
                408: "not answered within the request's own timeout parameter",
                413: "request above the size limits",
                415: "unsupported Content-Encoding",
                429: "queue full",
                503: "model not loaded yet",
                504: "not answered within the server's request timeout",
            }
        ),
    },
}


def _model(known: KnownModels, name: str, version: str | None) -> ServingModel:
    """The model a path names: 404 for an unknown model or version, 503 while it loads or when it failed to."""
    model = known.models.get(name)
    metadata.check_version(known.models, name, version)
    return model


async def _infer(request: Request, known: KnownModels, name: str, version: str | None) -> Response:
    """POST /v2/models/{name}[/versions/{version}]/infer: the model resolved once, by the request core, before the
    body is read (404 or 503 first)."""
    start = time.perf_counter()
    metadata.check_version(known.models, name, version)
    settings = known.settings
    request_codec = codec.InferCodec(
        name, request.headers.get(codec.HEADER_LENGTH), settings.max_elements, TextLimits.of(settings)
    )
    call = http_call(request, "v2", start, named=name)
    body = lambda: read_then_watch(request, call, settings.max_body_bytes)  # noqa: E731 (read once resolved)
    (payload, headers), timings = await inference.run(known, call, request_codec, read=body)
    headers.update(timing_headers(timings, time.perf_counter() - start))
    return Response(payload, headers=headers, media_type=headers.pop("Content-Type"))


# Two functions, not one with an optional ``version``: that would document a ``?version=`` query parameter on the
# first path. The inference routes are declared first: the router tries routes in order, and these carry the traffic.
@router.post("/models/{name}/infer", summary="Inference", openapi_extra=_INFER_DOC)
@direct
async def model_infer(name: str, request: Request, known: Known) -> Response:
    return await _infer(request, known, name, None)


@router.post(
    "/models/{name}/versions/{version}/infer", summary="Inference (one version)", openapi_extra=_INFER_DOC
)
@direct
async def model_version_infer(name: str, version: str, request: Request, known: Known) -> Response:
    return await _infer(request, known, name, version)


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": "addnorm", "version": VERSION, "extensions": codec.EXTENSIONS}


@router.get("/health/live", summary="Server liveness")
async def live() -> dict:
    return {"live": True}


@router.get(
    "/health/ready",
    summary="Server readiness (503 until the model is loaded)",
    responses=error_docs({503: "model not loaded yet"}),
)
async def ready(state: State) -> Response:
    reason = state.not_ready_reason()
    if reason is not None:
        return JSONResponse({"error": reason}, status_code=503)
    return JSONResponse({"ready": True})


# Before /models/{name}: the router tries routes in order, and "stats" would otherwise read as a model's name.
@router.get(
    "/models/stats", summary="Statistics of every loaded model (statistics extension)", responses=_ERRORS
)
@router.get("/models/{name}/stats", summary="Statistics of one model", responses=_ERRORS)
@router.get(
    "/models/{name}/versions/{version}/stats", summary="Statistics of one model version", responses=_ERRORS
)
async def model_statistics(known: Known, name: str | None = None, version: str | None = None) -> dict:
    return metadata.statistics(known.models, name, version, live_parity=True)


@router.get("/models/{name}", summary="Model metadata", responses=_ERRORS)
@router.get("/models/{name}/versions/{version}", summary="Model metadata (one version)", responses=_ERRORS)
async def model_metadata(name: str, known: Known, version: str | None = None) -> dict:
    model = _model(known, name, version)
    return {
        **metadata.model_metadata(model.engine.manifest, model.version),
        "parameters": {"verification": model.verification.to_dict()},
    }


@router.get("/models/{name}/config", summary="Model configuration (Triton's ModelConfig)", responses=_ERRORS)
@router.get(
    "/models/{name}/versions/{version}/config",
    summary="Model configuration (one version)",
    responses=_ERRORS,
)
async def model_configuration(name: str, known: Known, version: str | None = None) -> dict:
    return metadata.model_configuration(_model(known, name, version))


@router.get("/models/{name}/ready", summary="Model readiness", responses=_ERRORS)
@router.get(
    "/models/{name}/versions/{version}/ready", summary="Model readiness (one version)", responses=_ERRORS
)
async def model_ready(name: str, known: Known, version: str | None = None) -> dict:
    _model(known, name, version)
    return {"name": name, "ready": True}


@router.post(
    "/repository/index",
    summary="Every model this server was given, with its state (READY, LOADING, UNAVAILABLE)",
    responses=_ERRORS,
)
async def repository_index(request: Request, known: Known) -> Response:
    body = await read_body(request, 4096)
    ready_only = False
    if body.strip():
        doc = parse_json(body, 16)
        ready_only = doc.get("ready", False) if isinstance(doc, dict) else None
        if not isinstance(ready_only, bool):
            raise BadInput('the body must be empty or {"ready": true|false}')
    return JSONResponse(metadata.repository_index(known.models, ready_only))


async def _control_parameters(request: Request, unload: bool = False) -> None:
    """Triton's load/unload body: empty, or {"parameters": {...}} (none taken: check_parameters)."""
    body = await read_body(request, 65536)
    doc = parse_json(body, 0) if body.strip() else {}
    params = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(params, dict | None):
        raise BadInput('the body must be empty or {"parameters": {...}}')
    check_parameters(list(params or ()), unload)


@router.post(
    "/repository/models/{name}/load",
    summary="Load or reload a model of the repository (model control: explicit mode)",
    responses=_ERRORS,
)
async def repository_model_load(name: str, request: Request, state: State, known: Known) -> dict:
    await _control_parameters(request)
    await state.control.load(name)
    return {}


@router.post(
    "/repository/models/{name}/unload",
    summary="Unload a model once its requests in flight are answered (model control: explicit mode)",
    responses=_ERRORS,
)
async def repository_model_unload(name: str, request: Request, state: State, known: Known) -> dict:
    await _control_parameters(request, unload=True)
    await state.control.unload(name)
    return {}


def examples(model: str, d_model: int) -> dict[tuple[str, str], dict]:
    """The inference request example for the served model (service/protocols/docs.py): [1, 2, d_model] in JSON."""
    example = {
        "id": "42",
        "inputs": [
            {"name": EMBEDDINGS, "shape": [1, 2, d_model], "datatype": "FP32", "data": [0.1] * (2 * d_model)}
        ],
        "outputs": [{"name": ENCODED, "parameters": {"binary_data": False}}],
    }
    return {
        (path, "post"): example
        for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer")
    }


MODEL_PREFIXES = ("/v2/models/", "/v2/repository/")  # the guard checks everything under these prefixes
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready")
