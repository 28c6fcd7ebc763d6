"""create_app(settings): the FastAPI application, its front and its error handlers. Outermost first: the HTTP front
(front.middleware.Front: request id, access line, metrics, the guard, the body's deadline; its direct lane answers the
inference routes), called by the app itself (``_App.__call__``) -> FastAPI's own stack and router: the other routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from addnorm import __version__ as VERSION
from addnorm.service import logs, protocols
from addnorm.service.backend.engine import freeze_heap, limit_arenas
from addnorm.service.front.middleware import Front, install_error_handlers
from addnorm.service.guard import Guard
from addnorm.service.models.state import ServiceState, load_models, load_then_watch
from addnorm.service.protocols import docs, health
from addnorm.service.settings import Settings
from addnorm.service.tracing import TRACING


def create_app(
    settings: Settings | None = None,
    *,
    load_before_serving: bool = False,
    exit_on_error: bool = False,
    answer_request_id: bool = True,
) -> FastAPI:
    """Build the app. By default the models load in parallel in the background after start-up and /health/ready
    is 503 until all have. ``load_before_serving`` makes start-up itself wait for them and fail when one cannot
    load: for hosts that count an instance as serving once its start-up ends (Ray Serve replicas,
    service/ray_serve.py). With ``grpc_port`` set, the gRPC service starts with the app, on its event loop.
    ``exit_on_error``: with model control off, the process stops itself when no model could be loaded
    (``state.load_then_watch``). ``answer_request_id``: answers carry ``x-request-id`` (off: Ray's proxy adds it).
    """
    factory = settings is None  # uvicorn --factory, several workers: configured from the environment
    if factory:
        settings = Settings()
        logs.configure(settings.log_level, settings.log_json)
    limit_arenas()  # before the inference and offload threads start (service/backend/engine.py)
    TRACING.configure()  # on only when the OTEL_EXPORTER_OTLP_* variables ask for it
    state = ServiceState(settings)
    public = protocols.PUBLIC_PATHS | ({health.METRICS_PATH} if settings.metrics_public else set())
    guard = Guard(state, public_paths=public, model_prefixes=protocols.MODEL_PREFIXES)  # HTTP's and gRPC's

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load_before_serving:
            await load_models(state)
            if state.not_ready_reason() is not None:
                raise RuntimeError(state.not_ready_reason())
        # Transports with their own listener (gRPC), before the models load unless they already have: their
        # readiness answers false until they are. Each may decline (its port set to 0).
        state.live.start(asyncio.get_running_loop())
        listeners = [lst for t in protocols.LISTENERS if (lst := await t.listen(state, guard)) is not None]
        loader = None if load_before_serving else asyncio.create_task(load_then_watch(state, exit_on_error))
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
            state.live.stop()
            for listener in listeners:  # in-flight calls finish, new ones are refused
                await listener.stop(settings.request_timeout_s)
            if state.known is not None:  # replaced models drain, then every batcher stops
                await state.known.models.close()
            TRACING.shutdown()

    app = _App(
        title="addnorm",
        summary="A Transformer encoder block (Add & Norm) on onnxruntime",
        description="`/v1`: a simple JSON (or binary) API. `/v2`: the Open Inference Protocol with the binary "
        'tensor extension, for tritonclient and other KServe V2 clients. Errors are `{"error": "..."}`, and in their API\'s '
        "own shape on the OpenAI and text-embeddings-inference routes.",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,  # service/protocols/docs.py: the same pages from installed assets, not a CDN
        redoc_url=None,
        # service/tracing.py traces each request (one span per request, every transport): FastAPI's own
        # OpenTelemetry spans would trace HTTP requests a second time.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.addnorm = state
    for router in (*protocols.ROUTERS, docs.router):
        app.include_router(router)
    install_error_handlers(app)
    app.front = Front(
        app.routed, guard, settings.access_log, settings.body_timeout_s, app.router.routes, answer_request_id
    )
    if factory:  # this worker process's app is built (cli._run does it for one process)
        freeze_heap()
    return app


class _App(FastAPI):
    """FastAPI, behind the HTTP front, with its OpenAPI document made true to this server."""

    front: Front  # create_app's

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every HTTP request through the front first (it hands what its direct lane does not answer to ``routed``),
        outside FastAPI's own stack: it sees every answer, a 500 of FastAPI's error middleware too; the lifespan."""
        if scope["type"] == "http":
            scope["app"] = self  # as Starlette sets it (the direct lane's Request reads the app through it)
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's own stack (error middleware, exception middleware, router): the routes the front hands on."""
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict:
        """FastAPI's schema, true to this server (service/protocols/docs.py): no 422s, examples for the served model."""
        return docs.finish(super().openapi(), self.state.addnorm.known)
