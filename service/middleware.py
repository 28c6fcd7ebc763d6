"""The HTTP front's own middleware (pure ASGI: request id, access line, metrics) and FastAPI's error handlers, which
answer every error as JSON ``{"error": ...}``."""

from __future__ import annotations

import itertools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import ServiceError
from service.responses import error_response, from_error, unexpected_error
from service.state import ServiceState


def install_error_handlers(app: FastAPI) -> None:
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


class RequestContext:
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
