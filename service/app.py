"""create_app(settings): the FastAPI application, its middleware and its error handlers.

Outermost first: request context (id, access log, metrics) -> guard -> fast path -> FastAPI's own stack and router.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.artifact import ArtifactError, Manifest
from service import logs, memory, protocols
from service.batcher import Batcher, Observers
from service.engine import Engine
from service.errors import ServiceError
from service.fastpath import FastPath
from service.guard import Guard, GuardMiddleware
from service.protocols import health
from service.protocols.v2 import grpc_server
from service.protocols.v2.codec import VERSION
from service.responses import error_response, from_error, unexpected_error
from service.settings import Settings
from service.state import READY, UNAVAILABLE, LoadedState, Models, ServiceState, ServingModel, Slot
from service.statistics import ModelStatistics
from service.tracing import TRACING
from service.verification import Verification, verify_engine

log = logging.getLogger("addnorm.service")


def create_app(settings: Settings | None = None, *, load_before_serving: bool = False) -> FastAPI:
    """Build the app. By default the models load in parallel in the background after start-up and /health/ready
    is 503 until all have. ``load_before_serving`` makes start-up itself wait for them and fail when one cannot
    load: for hosts that count an instance as serving once its start-up ends (Ray Serve replicas,
    service/ray_serve.py). With ``grpc_port`` set, the gRPC service starts with the app, on its event loop.
    """
    if settings is None:  # factory mode (uvicorn --factory, several workers): configure from the environment
        settings = Settings()
        logs.configure(settings.log_level, settings.log_json)
    memory.limit_arenas()  # before the inference and offload threads start (service/memory.py)
    TRACING.configure()  # on only when the OTEL_EXPORTER_OTLP_* variables ask for it
    state = ServiceState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load_before_serving:
            await _load(state)
            if state.not_ready_reason() is not None:
                raise RuntimeError(state.not_ready_reason())
        # Before the models load (unless they already have): ServerReady answers false until they are.
        grpc = await grpc_server.start(state) if settings.grpc_port else None
        loader = None if load_before_serving else asyncio.create_task(_load(state))
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
            if grpc is not None:
                await grpc.stop(settings.request_timeout_s)  # in-flight calls finish, new ones are refused
            if state.loaded is not None:
                for model in state.loaded.models:
                    await model.batcher.stop()
            TRACING.shutdown()

    app = _App(
        title="addnorm",
        summary="A Transformer encoder block (Add & Norm) on onnxruntime",
        description="`/v1`: a simple JSON (or binary) API. `/v2`: the Open Inference Protocol with the binary "
        'tensor extension, for tritonclient and other KServe V2 clients. Errors are always `{"error": "..."}`.',
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.addnorm = state
    for router in protocols.ROUTERS:
        app.include_router(router)
    _install_error_handlers(app)
    public = protocols.PUBLIC_PATHS | ({health.METRICS_PATH} if settings.metrics_public else set())
    state.guard = Guard(state, public_paths=public, model_prefixes=protocols.MODEL_PREFIXES)
    app.front = _RequestContext(
        GuardMiddleware(FastPath(app.fastapi_call, routes=protocols.FAST_ROUTES), state.guard),
        state=state,
        access_log=settings.access_log,
    )
    return app


class _App(FastAPI):
    """FastAPI, with addnorm's own front outermost for HTTP: request context -> guard -> fast path, and only then
    FastAPI's stack (its error, telemetry and body-limit middlewares, router, dependencies). The inference routes
    never enter FastAPI's stack: on a 2-core machine its per-request work competes with onnxruntime (bench/,
    docs/benchmarks.md). Lifespan and anything not HTTP go to FastAPI as they are."""

    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["app"] = self
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def add_outer_middleware(self, middleware: Callable[[ASGIApp], ASGIApp]) -> None:
        """Wrap the whole front (``add_middleware`` adds inside FastAPI's stack, which fast routes never enter)."""
        self.front = middleware(self.front)

    async def fastapi_call(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def read_manifests(settings: Settings) -> list[Slot]:
    """Every model to serve, named by its manifest, in order. Raises ValueError (with every directory involved)
    for an unreadable manifest, a missing repository or two models of one name."""
    slots: list[Slot] = []
    for directory in settings.model_dirs():
        try:
            name = Manifest.load(directory).name
        except (ArtifactError, OSError) as exc:
            raise ValueError(str(exc) if str(directory) in str(exc) else f"{directory}: {exc}") from None
        same = [s.directory for s in slots if s.name == name]
        if same:
            raise ValueError(
                f"two models are named {name!r}: {same[0]} and {directory}; give one another name "
                "(addnorm-export --name) or serve them from different servers"
            )
        slots.append(Slot(name, Path(directory)))
    return slots


async def _load(state: ServiceState) -> None:
    """Read every manifest (names known: model routes answer 404/503 by name from here on), then load the
    models in parallel; each becomes READY or UNAVAILABLE with its reason."""
    try:
        slots = read_manifests(state.settings)
    except ValueError as exc:
        state.load_error = str(exc)
        log.error("cannot serve: %s", exc)
        return
    state.loaded = LoadedState(state.settings, Models(slots))
    await asyncio.gather(*(_load_one(state, slot) for slot in slots))
    if state.not_ready_reason() is None:
        log.info("ready: %s", ", ".join(f"{s.name} on {s.serving.engine.providers}" for s in slots))


async def _load_one(state: ServiceState, slot: Slot) -> None:
    try:
        slot.serving = await _serving_model(state, slot.directory)
        slot.state = READY
    except _LoadFailed as exc:
        slot.state, slot.reason = UNAVAILABLE, str(exc)
        log.error("model %s failed to load: %s", slot.name, exc)


class _LoadFailed(Exception):
    pass


async def _serving_model(state: ServiceState, directory: Path) -> ServingModel:
    s = state.settings
    try:
        engine = await asyncio.to_thread(Engine, directory, s.providers, s.intra_op_threads)
    except Exception as exc:  # any failure keeps the model (and /health/ready) unavailable, with the reason
        raise _LoadFailed(str(exc)) from None
    try:
        verification = await asyncio.to_thread(verify_engine, engine, directory, s.verify_on_load)
    except Exception as exc:  # unreadable golden data: not ready, with the reason
        raise _LoadFailed(f"golden check could not run: {type(exc).__name__}: {exc}") from None
    state.metrics.verification(engine.name, verification)
    if not _accept(verification, s.verify_on_load, engine.name):
        raise _LoadFailed(f"golden check failed on {verification.provider}: {verification.message}")
    statistics = ModelStatistics(engine.name, VERSION)
    # The queue-depth gauge reads the batcher (made just below) at each scrape.
    metrics = state.metrics.model(engine.name, queue_depth=lambda: batcher.depth)
    batcher = Batcher(
        engine,
        max_batch_size=s.max_batch_size,
        max_batch_tokens=s.max_batch_tokens,
        max_queue_delay_ms=s.max_queue_delay_ms,
        max_queue_size=s.max_queue_size,
        observer=Observers(metrics, statistics),
        max_batch_attention=s.max_batch_attention,
        heads=engine.manifest.config.nhead,
        attention=engine.attention,
        max_queue_bytes=s.max_queue_bytes,
    )
    batcher.start()
    return ServingModel(engine, batcher, verification, statistics)


def _accept(v: Verification, mode: str, name: str) -> bool:
    """Log the load-time check in one line; False when it failed under strict (the model is not served)."""
    if v.status == "passed":
        log.info(
            "golden check passed for %s on %s: max abs err %.3e (%d cases, %.2f s)",
            name,
            v.provider,
            v.max_abs_err,
            v.cases,
            v.seconds,
        )
        return True
    if v.status == "failed" and mode == "strict":
        log.error(
            "golden check FAILED for %s, refusing to serve (ADDNORM_VERIFY_ON_LOAD=strict): %s",
            name,
            v.message,
        )
        return False
    log.warning("golden check %s for %s: %s", v.status.upper(), name, v.message)
    return True


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        return from_error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error_response(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return unexpected_error(exc, request.method, request.url.path)


class _RequestContext:
    """Pure ASGI middleware: request id, access log and metrics, without BaseHTTPMiddleware's overhead."""

    def __init__(self, app: ASGIApp, state: ServiceState, access_log: bool = True) -> None:
        self.app = app
        self.state = state
        self.access_log = access_log
        # Request ids: a random per-process prefix and a counter (uuid4 per request was measurable here).
        self.prefix = uuid.uuid4().hex[:8]
        self.counter = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _header(scope, b"x-request-id") or f"{self.prefix}-{next(self.counter):x}"
        token = logs.request_id.set(rid)
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.state.metrics.observe_request(path, scope["method"], status, elapsed)
            if self.access_log:
                logs.access("%s %s %d %.1fms", scope["method"], scope["path"], status, elapsed * 1e3)
            logs.request_id.reset(token)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text = value.decode("latin-1")[:64]
            return text if text.isprintable() else None
    return None
