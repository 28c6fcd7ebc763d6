"""create_app(settings): the FastAPI application, its middleware and its error handlers.

Outermost first: the HTTP front (request id, access log, metrics; guard; fast routes) -> FastAPI's stack and router.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from service import logs, protocols
from service.engine import freeze_heap, limit_arenas
from service.guard import Guard, HttpFront, Respond, install_error_handlers
from service.protocols import docs, health
from service.settings import VERSION, Settings
from service.state import ServiceState, load_models, load_then_watch
from service.tracing import TRACING


def create_app(
    settings: Settings | None = None, *, load_before_serving: bool = False, exit_on_error: bool = False
) -> FastAPI:
    """Build the app. By default the models load in parallel in the background after start-up and /health/ready
    is 503 until all have. ``load_before_serving`` makes start-up itself wait for them and fail when one cannot
    load: for hosts that count an instance as serving once its start-up ends (Ray Serve replicas,
    service/ray_serve.py). With ``grpc_port`` set, the gRPC service starts with the app, on its event loop.
    ``exit_on_error``: with model control off, the process stops itself when no model could be loaded
    (``state.load_then_watch``).
    """
    factory = settings is None  # uvicorn --factory, several workers: configured from the environment
    if factory:
        settings = Settings()
        logs.configure(settings.log_level, settings.log_json)
    limit_arenas()  # before the inference and offload threads start (service/engine.py)
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
            if state.loaded is not None:  # replaced models drain, then every batcher stops
                await state.loaded.models.close()
            TRACING.shutdown()

    app = _App(
        title="addnorm",
        summary="A Transformer encoder block (Add & Norm) on onnxruntime",
        description="`/v1`: a simple JSON (or binary) API. `/v2`: the Open Inference Protocol with the binary "
        'tensor extension, for tritonclient and other KServe V2 clients. Errors are always `{"error": "..."}`.',
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,  # service/protocols/docs.py: the same pages from installed assets, not a CDN
        redoc_url=None,
    )
    app.state.addnorm = state
    for router in (*protocols.ROUTERS, docs.router):
        app.include_router(router)
    install_error_handlers(app)
    if factory:  # this worker process's app is built (cli._run does it for one process)
        freeze_heap()
    front = HttpFront(app.fastapi_call, guard, protocols.FAST_ROUTES, settings.access_log)
    app.front = app.direct_front = front
    return app


class _App(FastAPI):
    """FastAPI, with addnorm's own front outermost for HTTP (guard.HttpFront), and only then FastAPI's stack (its
    error, telemetry and body-limit middlewares, router, dependencies). The inference routes never enter FastAPI's
    stack: on a 2-core machine its per-request work competes with onnxruntime (bench/, docs/benchmarks.md).
    Lifespan and anything not HTTP go to FastAPI as they are."""

    front: ASGIApp
    direct_front: HttpFront | None  # the front's own way in, while no outer middleware wraps it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["app"] = self
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def openapi(self) -> dict:
        """FastAPI's schema, true to this server (service/protocols/docs.py): no 422s, examples for the served model."""
        return docs.finish(super().openapi(), self.state.addnorm.loaded)

    def add_outer_middleware(self, middleware: Callable[[ASGIApp], ASGIApp]) -> None:
        """Wrap the whole front (``add_middleware`` adds inside FastAPI's stack, which fast routes never enter)."""
        self.front, self.direct_front = middleware(self.front), None

    def direct(self, scope: Scope, receive: Receive, respond: Respond) -> Awaitable[None] | None:
        """A fast route's request answered by one ``respond`` (guard.HttpFront.direct, for service/transport/), else None."""
        scope["app"] = self
        return None if self.direct_front is None else self.direct_front.direct(scope, receive, respond)

    async def fastapi_call(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
