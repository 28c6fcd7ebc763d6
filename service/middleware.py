"""The HTTP front: its own middleware (pure ASGI: request id, access line, metrics), FastAPI's error handlers, which
answer every error as JSON ``{"error": ...}``, and the fast path.

``FastPath`` is a lean dispatcher for the inference routes, in front of FastAPI's router, middleware and
dependencies. On a 2-core machine every request's Python work competes with onnxruntime for the same cores, and FastAPI's
generic machinery (route matching, dependency solving, exception middleware) was about half of it (bench/).
Each protocol lists its hot routes as ``FastRoute``s; their handlers are the very functions its FastAPI routes
call (those stay registered for the OpenAPI docs). It sits inside the guard, so nothing here skips it.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import ServiceError, error_response, from_error, unexpected_error
from service.guard import loaded_state
from service.state import KnownModels, ServiceState


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


Handler = Callable[[Request, KnownModels, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    """``method`` + a full-path regex whose named groups become the handler's params; ``path`` is the route's
    template as FastAPI knows it (the metrics label)."""

    method: str
    pattern: re.Pattern[str]
    path: str
    handler: Handler


class FastPath:
    """Pure ASGI: requests matching a FastRoute go straight to its handler; everything else on to FastAPI."""

    def __init__(self, app: ASGIApp, routes: tuple[FastRoute, ...]) -> None:
        self.app = app
        self.routes = [(r, SimpleNamespace(path=r.path)) for r in routes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route, label in self.routes:
                if scope["method"] == route.method and (m := route.pattern.match(scope["path"])):
                    scope["route"] = label  # what the request context reads for its metrics
                    await self._dispatch(route, m.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _dispatch(route: FastRoute, params: dict, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await route.handler(request, await loaded_state(request), params)
        except ServiceError as exc:  # ClientGone included
            response = from_error(exc)
        except Exception as exc:  # same contract as the app's handler
            response = unexpected_error(exc, scope["method"], scope["path"])
        await response(scope, receive, send)
