"""What every request meets before its handler: the one guard, for every transport, and the rest of the HTTP front.

Every HTTP request passes the guard before any route, the fast path's or FastAPI's, and every gRPC call before its
method (an interceptor). It lets the health probes through untouched; every other path needs a valid API key when
keys are set (``Authorization: Bearer <key>``, one of them, compared in constant time), and model paths need the
models' manifests read (each handler then answers 503 for a model still loading, 404 for a name no manifest has).
An HTTP route that needs the models gets them from the guard (``Known``), so a model route the guard did not cover
fails loudly instead of serving unguarded; ``tests/service/test_guard.py`` tries every route the app serves and
every gRPC method.

The HTTP front (``HttpFront``): request id, access line and metrics; the guard; and the fast routes, the inference
routes in front of FastAPI's router, middleware and dependencies. On a 2-core machine every request's Python work
competes with onnxruntime for the same cores, and FastAPI's generic machinery (route matching, dependency solving,
exception middleware) was about half of it (bench/). Each protocol lists its hot routes as ``FastRoute``s; their
handlers are the very functions its FastAPI routes call (those stay registered for the OpenAPI docs). FastAPI's
error handlers answer every other error as JSON ``{"error": ...}``.
"""

from __future__ import annotations

import hmac
import itertools
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextvars import Token
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import (
    NotReady,
    ServiceError,
    Unauthenticated,
    error_response,
    from_error,
    unexpected_error,
)
from service.state import KnownModels, ServiceState

SCOPE_KEY = "addnorm.loaded"  # where the guard leaves the KnownModels for the routes past it


class Guard:
    """Decides whether a request may reach its handler, from its path (an HTTP path, or a gRPC method's full
    name such as ``/inference.GRPCInferenceService/ModelInfer``) and the credentials it carries (every value of
    its ``authorization`` header or metadata). The HTTP front (``HttpFront``) and the gRPC server's
    interceptor (``grpc_server.GuardInterceptor``) both ask it, so a new check here holds for every transport.

    ``public_paths``: served without checks (health probes); ``model_prefixes``: paths whose handlers use the
    models, refused with 503 until the manifests are read; the API keys are the state's (none = open).
    """

    def __init__(
        self, state: ServiceState, public_paths: frozenset[str], model_prefixes: tuple[str, ...]
    ) -> None:
        self.state = state
        self.public_paths = public_paths
        self.model_prefixes = model_prefixes

    def check(self, path: str, credentials: Callable[[], Sequence[bytes]]) -> KnownModels | None:
        """Raise a ServiceError to refuse the request; return the loaded state for model paths. ``credentials``
        is asked only when keys are set."""
        if path in self.public_paths:
            return None
        if self.state.api_keys:
            check_key(credentials(), self.state.api_keys)
        if not path.startswith(self.model_prefixes):
            return None
        if self.state.loaded is None:
            raise NotReady(self.state.not_ready_reason() or "model is loading")
        return self.state.loaded


def check_key(credentials: Sequence[bytes], api_keys: tuple[bytes, ...]) -> None:
    """Exactly one ``Authorization: Bearer <key>`` (an HTTP header or gRPC metadata) with one of the keys; raises
    Unauthenticated. Two credentials are refused whatever they hold, so no transport picks one of them. Never
    says which key part was wrong, never logs the key."""
    if not credentials:
        raise Unauthenticated("this server needs an API key: send 'Authorization: Bearer <key>'")
    if len(credentials) > 1:
        raise Unauthenticated(f"send one Authorization header, not {len(credentials)}")
    scheme, _, token = credentials[0].partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <key>'")
    token = token.strip()
    matched = False
    for key in api_keys:  # every key compared, each in constant time
        matched |= hmac.compare_digest(token, key)
    if not matched:
        raise Unauthenticated("invalid API key")


# Async on purpose: FastAPI runs a plain ``def`` dependency in a worker thread, a hop that costs more than the
# rest of a small request's handling (bench/).
async def loaded_state(request: Request) -> KnownModels:
    """The models the guard let this request reach (FastAPI dependency; the fast path reads the same key)."""
    try:
        return request.scope[SCOPE_KEY]
    except KeyError:
        raise RuntimeError(
            f"{request.url.path} uses the models but the guard did not check it: add its prefix to its "
            "protocol's MODEL_PREFIXES"
        ) from None


Known = Annotated[KnownModels, Depends(loaded_state)]


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


class HttpFront:
    """Every HTTP request, outermost first: its context (request id, access line, metrics), the guard, then a fast
    route's handler or FastAPI. Two ways in, the same steps: ``__call__`` (pure ASGI, any ASGI server) and
    ``direct`` (this server's connection, service/transport/: a fast route's whole answer in one call, without
    ASGI messages, Starlette's request or the layers between: 14-24% less of the event loop's work per small
    request, docs/benchmarks.md)."""

    def __init__(
        self, app: ASGIApp, guard: Guard, routes: tuple[FastRoute, ...], access_log: bool = True
    ) -> None:
        self.app, self.guard, self.state, self.access_log = app, guard, guard.state, access_log
        self.routes = [(r, SimpleNamespace(path=r.path)) for r in routes]
        # Request ids: a random per-process prefix and a counter (uuid4 per request was measurable here).
        self.prefix, self.counter = uuid.uuid4().hex[:8], itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, token, start = self._begin(scope)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            if (hit := self._match(scope)) is not None:
                await (await self._answer(*hit, scope, receive))(scope, receive, send_with_id)
                return
            try:
                self._check(scope)
            except ServiceError as exc:
                await from_error(exc)(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            self._end(scope, status, start, token)

    def direct(self, scope: Scope, receive: Receive, respond: Respond) -> Awaitable[None] | None:
        """A fast route's request, answered by one ``respond(status, headers, body)``; None for any other."""
        hit = self._match(scope)
        return None if hit is None else self._direct(hit, scope, receive, respond)

    async def _direct(self, hit: tuple, scope: Scope, receive: Receive, respond: Respond) -> None:
        rid, token, start = self._begin(scope)
        status = 500
        try:
            response = await self._answer(*hit, scope, receive)
            status = response.status_code
            await respond(status, [*response.raw_headers, (b"x-request-id", rid.encode())], response.body)
        finally:
            self._end(scope, status, start, token)

    def _begin(self, scope: Scope) -> tuple[str, Token, float]:
        rid = _header(scope, b"x-request-id") or f"{self.prefix}-{next(self.counter):x}"
        return rid, logs.request_id.set(rid), time.perf_counter()

    def _end(self, scope: Scope, status: int, start: float, token: Token) -> None:
        elapsed = time.perf_counter() - start
        path = getattr(scope.get("route"), "path", "unmatched")
        self.state.metrics.observe_request(path, scope["method"], status, elapsed)
        if self.access_log:
            logs.access("%s %s %d %.1fms", scope["method"], scope["path"], status, elapsed * 1e3)
        logs.request_id.reset(token)

    def _check(self, scope: Scope) -> KnownModels | None:
        """The guard: a ServiceError refuses; a model route finds its models in its scope (``Known``)."""
        loaded = self.guard.check(
            scope["path"], lambda: [v for k, v in scope["headers"] if k == b"authorization"]
        )
        if loaded is not None:
            scope[SCOPE_KEY] = loaded
        return loaded

    def _match(self, scope: Scope) -> tuple[FastRoute, SimpleNamespace, dict] | None:
        for route, label in self.routes:
            if scope["method"] == route.method and (m := route.pattern.match(scope["path"])):
                return route, label, m.groupdict()
        return None

    async def _answer(
        self, route: FastRoute, label: SimpleNamespace, params: dict, scope: Scope, receive: Receive
    ) -> Response:
        """A fast route's answer, a refusal included (the guard's or the handler's: JSON, with its status)."""
        try:
            loaded = self._check(scope)
            if loaded is None:
                raise RuntimeError(
                    f"{scope['path']} uses the models: add its prefix to its protocol's MODEL_PREFIXES"
                )
            scope["route"] = label  # what the request context reads for its metrics
            return await route.handler(HttpRequest(scope, receive), loaded, params)
        except ServiceError as exc:  # ClientGone included
            return from_error(exc)
        except Exception as exc:  # same contract as the app's handler
            return unexpected_error(exc, scope["method"], scope["path"])


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text = value.decode("latin-1")[:64]
            return text if text.isprintable() else None
    return None


class HttpRequest:
    """What a fast route's handler reads of its request, made for it alone (Starlette's ``Request`` scans and
    re-encodes its header list at each lookup, a share of a small request's work: docs/benchmarks.md). ``headers``: each
    field's first value by lower-case name, ``get`` in any case; ``query_params``; ``scope`` and ``receive`` (the body:
    protocols.common.read_body) as ASGI gives them."""

    __slots__ = ("scope", "receive", "headers")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope, self.receive = scope, receive
        self.headers = _Headers()
        for key, value in scope["headers"]:
            self.headers.setdefault(key.decode("latin-1"), value.decode("latin-1"))

    @classmethod
    def of(cls, request: Request) -> HttpRequest:
        """The same request, from FastAPI's (a fast route's handler called by its FastAPI route)."""
        return cls(request.scope, request.receive)

    @property
    def query_params(self) -> QueryParams:
        return QueryParams(self.scope.get("query_string", b""))


class _Headers(dict[str, str]):
    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)


Handler = Callable[[HttpRequest, KnownModels, dict[str, str]], Awaitable[Response]]
Respond = Callable[[int, list[tuple[bytes, bytes]], bytes], Awaitable[None]]  # status, headers, body


@dataclass(frozen=True)
class FastRoute:
    """``method`` + a full-path regex whose named groups become the handler's params; ``path`` is the route's
    template as FastAPI knows it (the metrics label)."""

    method: str
    pattern: re.Pattern[str]
    path: str
    handler: Handler
