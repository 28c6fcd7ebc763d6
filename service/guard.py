"""What every request meets before its handler: the one guard, for every transport, and the rest of the HTTP front.

Every HTTP request passes the guard before any route, and every gRPC call before its
method (an interceptor). It lets the health probes through untouched; every other path needs a valid API key when
keys are set (``Authorization: Bearer <key>``, one of them, compared in constant time), and model paths need the
models' manifests read (each handler then answers 503 for a model still loading, 404 for a name no manifest has).
An HTTP route that needs the models gets them from the guard (``Known``), so a model route the guard did not cover
fails loudly instead of serving unguarded; ``tests/service/test_guard.py`` tries every route the app serves and
every gRPC method.

The HTTP front (``Front``, one pure ASGI middleware outermost in the app): request id, access line and metrics, the
guard, the body's deadline; FastAPI's routes do the rest, each written once (its declaration is its OpenAPI entry).
FastAPI's error handlers (``install_error_handlers``) answer every error as JSON ``{"error": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import (
    BodyTimeout,
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
    its ``authorization`` header or metadata). The HTTP front (``Front``) and the gRPC server's
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
    """The models the guard let this request reach (FastAPI dependency)."""
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


class Front:
    """Every HTTP request, outermost first (one pure ASGI middleware, under any ASGI server: uvicorn, a test client,
    Ray Serve's proxy): its context (request id, access line, metrics), the guard, and the body's deadline; then
    FastAPI's router. A model route finds the models the guard let it reach in its scope (``Known``).

    ``body_timeout_s``: a request's body must arrive within this time of the request's start, else 408 and the
    connection closes (uvicorn has no such limit: a body trickled a byte at a time would hold its connection).
    """

    def __init__(self, app: ASGIApp, guard: Guard, access_log: bool, body_timeout_s: float) -> None:
        self.app, self.guard, self.state, self.access_log = app, guard, guard.state, access_log
        self.body_timeout_s = body_timeout_s
        # Request ids: a random per-process prefix and a counter (uuid4 per request was measurable here).
        self.prefix, self.counter = uuid.uuid4().hex[:8], itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _header(scope, b"x-request-id") or f"{self.prefix}-{next(self.counter):x}"
        token, start = logs.request_id.set(rid), time.perf_counter()
        status, body = 500, _Body(receive, start + self.body_timeout_s, self.body_timeout_s)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                if not body.done and not body.late:  # answered before its body was read (a 413, say)
                    await body.drain()
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                if body.late:  # what is left of a late body is never read: the connection closes
                    headers.append((b"connection", b"close"))
                message["headers"] = headers
            await send(message)

        try:
            try:
                self._check(scope)
            except ServiceError as exc:
                await from_error(exc)(scope, receive, send_with_id)
                return
            await self.app(scope, body.receive, send_with_id)
        finally:
            body.close()
            elapsed = time.perf_counter() - start
            path = getattr(scope.get("route"), "path", "unmatched")
            self.state.metrics.observe_request(path, scope["method"], status, elapsed)
            if self.access_log:
                logs.access("%s %s %d %.1fms", scope["method"], scope["path"], status, elapsed * 1e3)
            logs.request_id.reset(token)

    def _check(self, scope: Scope) -> None:
        """The guard: a ServiceError refuses; a model route finds its models in its scope (``Known``)."""
        loaded = self.guard.check(
            scope["path"], lambda: [v for k, v in scope["headers"] if k == b"authorization"]
        )
        if loaded is not None:
            scope[SCOPE_KEY] = loaded


LINGER_S = 2.0  # an early answer waits this long at most for the rest of its body to be read and dropped ...
LINGER_BYTES = 64 * 1024 * 1024  # ... and for this much of it at most


class _Body:
    """A request's ``receive`` with its body due by ``due`` (``time.perf_counter``'s clock): a body message that has
    not come by then raises ``BodyTimeout`` in the route reading it (a 408), and ``late`` tells the front to close
    the connection after the answer. Past the body, ``receive`` is the server's own (the request core waits on it
    for the client going away). One timer per request whose body is read, armed at its first read: it cancels only
    a read still waiting for the body (``asyncio.timeout`` per read cost a small request ~8% more of the loop).

    ``drain``: an answer given before the body was read (a 413 refused on its Content-Length, say) first reads
    and drops what is still coming, within ``LINGER_S`` and ``LINGER_BYTES``: a connection closed with unread bytes
    is reset by the kernel, and a client still writing its body would lose the answer (nginx's lingering close)."""

    __slots__ = ("_receive", "due", "seconds", "late", "done", "_timer", "_waiting", "_expired")

    def __init__(self, receive: Receive, due: float, seconds: float) -> None:
        self._receive, self.due, self.seconds, self.late, self.done = receive, due, seconds, False, False
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task | None = None  # the task waiting in a read of the body, if one is
        self._expired = False

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()
        if self._expired:
            raise self._late()
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, self.due - time.perf_counter()), self._expire)
        self._waiting = asyncio.current_task()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            if not self._expired or self._waiting is None:
                raise
            self._waiting.uncancel()  # the cancellation was this deadline's, not the server's
            raise self._late() from None
        finally:
            self._waiting = None
        self.done = message["type"] != "http.request" or not message.get("more_body", False)
        if self.done:
            self._timer.cancel()
        return message

    def _expire(self) -> None:
        self._expired = True
        if self._waiting is not None:
            self._waiting.cancel()

    def _late(self) -> BodyTimeout:
        self.late = True
        return BodyTimeout(f"request body not received within {self.seconds:g} s")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    async def drain(self) -> None:
        """Read and drop the rest of the body, within ``LINGER_S`` and ``LINGER_BYTES``."""
        self.close()
        dropped = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(LINGER_S, max(0.0, self.due - time.perf_counter()))):
                while not self.done and dropped <= LINGER_BYTES:
                    message = await self._receive()
                    dropped += len(message.get("body", b""))
                    self.done = message["type"] != "http.request" or not message.get("more_body", False)
        self.late = self.late or not self.done  # what is still coming is never read: the connection closes


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text = value.decode("latin-1")[:64]
            return text if text.isprintable() else None
    return None
