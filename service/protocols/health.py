"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from addnorm.service.models.state import State

router = APIRouter(tags=["health"])
METRICS_PATH = "/metrics"  # public too with ADDNORM_METRICS_PUBLIC


@router.get("/health/live", summary="The process is up")
async def live() -> dict:
    return {"status": "live"}


@router.get(
    "/health/ready",
    summary="Every model is loaded and accepting requests (503 until then)",
    responses={503: {"description": "still loading, or failed to load", "content": {"application/json": {}}}},
)
async def ready(state: State) -> Response:
    reason = state.not_ready_reason()
    if reason is not None or state.known is None:
        reason = reason or "model is loading"
        return JSONResponse({"error": reason}, status_code=503, headers={"Retry-After": "1"})
    models = list(state.known.models)  # the loaded ones: none at all is ready too, under model control
    default = models[0].engine if models else None
    return JSONResponse(
        {
            "status": "ready",
            "model": default.name if default else None,
            "providers": default.providers if default else [],
            "models": {m.name: m.engine.providers for m in models},
        }
    )


@router.get(METRICS_PATH, summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


MODEL_PREFIXES: tuple[str, ...] = ()
PUBLIC_PATHS = ("/health/live", "/health/ready")
