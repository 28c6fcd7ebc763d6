"""The HTTP front's one middleware and its error handlers: what every HTTP request meets before its route.

``Front`` (pure ASGI, outermost in the app under any ASGI server: uvicorn, a test client, Ray Serve's proxy): the
request's context (id, access line, metrics), the guard (service/guard.py, the same object gRPC's interceptor asks)
and the body's deadline. FastAPI's routes do the rest, each written once (its declaration is its OpenAPI entry);
``install_error_handlers`` answers every error as JSON in its API's shape (``protocols.error_shape``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import RouteContext, iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from addnorm.service import logs
from addnorm.service.errors import BodyTimeout, ServiceError, error_response, from_error, unexpected_error
from addnorm.service.guard import SCOPE_KEY, Guard, known_models
from addnorm.service.protocols import error_shape


def error_answer(request: Request, exc: Exception) -> Response:
    """An error as JSON in the shape of the API its path belongs to (protocols.error_shape): a domain error with its
    status, FastAPI's validation and HTTP errors as theirs, anything else a logged 500."""
    path = request.scope["path"]
    shape = error_shape(path)
    if isinstance(exc, ServiceError):
        return from_error(exc, shape)
    if isinstance(exc, RequestValidationError):
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error_response(400, "; ".join(parts) or "invalid request", shape=shape)
    if isinstance(exc, StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None), shape)
    return unexpected_error(exc, request.method, path, shape)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as JSON in its API's shape (``error_answer``), for FastAPI's routes; the front's direct lane
    answers its routes' errors with the same function."""

    async def handler(request: Request, exc: Exception) -> Response:
        return error_answer(request, exc)

    for kind in (ServiceError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handler)


class Front:
    """Every HTTP request, outermost first (one pure ASGI middleware, under any ASGI server: uvicorn, a test client,
    Ray Serve's proxy): its context (request id, access line, metrics), the guard, and the body's deadline; then
    ``app``, FastAPI's own stack and router. A model route finds the models the guard let it reach in its scope
    (``Known``). The app calls it first (front/app.py), outside FastAPI's own middleware.

    ``answer_request_id``: each answer carries the request's id (``x-request-id``: the client's own, else one made here),
    as the log lines do; off behind a proxy that adds its own to every answer (Ray Serve's).

    ``body_timeout_s``: a request's body must arrive within this time of the request's start, else 408 and the
    connection closes (uvicorn has no such limit: a body trickled a byte at a time would hold its connection).

    ``routes``: the app's routes; those whose endpoint is marked ``protocols.common.direct`` (the inference routes)
    the front calls itself, in the direct lane (``_lane``, ``_direct``): the same endpoint, answer and errors, less
    FastAPI's routing, exception middleware and dependency solving, most of the event loop's time a small request
    spends outside its own handling.
    """

    def __init__(
        self,
        app: ASGIApp,
        guard: Guard,
        access_log: bool,
        body_timeout_s: float,
        routes: Sequence = (),
        answer_request_id: bool = True,
    ) -> None:
        self.app, self.guard, self.state, self.access_log = app, guard, guard.state, access_log
        self.answer_request_id = answer_request_id
        self.body_timeout_s = body_timeout_s
        self.routes, self._lanes = routes, None
        # Request ids: a random per-process prefix and a counter (uuid4 per request was measurable here).
        self.prefix, self.counter = uuid.uuid4().hex[:8], itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _header(scope, b"x-request-id") or f"{self.prefix}-{next(self.counter):x}"
        token, start = logs.request_id.set(rid), time.perf_counter()
        status, body = 500, _Body(receive, start + self.body_timeout_s, self.body_timeout_s)
        body.done = (
            scope["method"] in _BODILESS
        )  # nothing to wait for or drain: the server's receive as it is

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                if not body.done and not body.late:  # answered before its body was read (a 413, say)
                    await body.drain()
                status = message["status"]
                headers = [*message.get("headers", ())]
                if self.answer_request_id:
                    headers.append((b"x-request-id", rid.encode()))
                if body.late:  # what is left of a late body is never read: the connection closes
                    headers.append((b"connection", b"close"))
                message["headers"] = headers
            await send(message)

        try:
            try:
                self._check(scope)
            except ServiceError as exc:
                await from_error(exc, error_shape(scope["path"]))(scope, receive, send_with_id)
                return
            lane = self._lane(scope)
            if lane is None:
                await self.app(scope, body.receive, send_with_id)
            else:
                await _direct(*lane, scope, body.receive, send_with_id)
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
        known = self.guard.check(
            scope["path"], lambda: [v for k, v in scope["headers"] if k == b"authorization"]
        )
        if known is not None:
            scope[SCOPE_KEY] = known

    def _lane(self, scope: Scope) -> tuple[RouteContext, dict] | None:
        """The direct route this request is for and its path's parameters, else None (FastAPI routes it). The routes
        are read at the first request, once every router is included; a direct route's path matches no route
        declared before it (tests/service/test_front.py), so the route found is the one FastAPI's router would take."""
        if self._lanes is None:  # FastAPI's own view of the routes, included routers' too, read once (each
            # attribute of a RouteContext is a lookup through its layers: a few microseconds a route a request)
            self._lanes = [
                (frozenset(r.methods), r.path_regex.match, r.param_convertors, r)
                for r in iter_route_contexts(self.routes)
                if getattr(r.endpoint, "direct", False)
            ]
        if scope.get("root_path"):  # mounted under a prefix: FastAPI's router strips it
            return None
        path, method = scope["path"], scope["method"]
        for methods, match_path, convertors, route in self._lanes:
            if method in methods and (match := match_path(path)) is not None:
                return route, {k: convertors[k].convert(v) for k, v in match.groupdict().items()}
        return None


async def _direct(route: RouteContext, params: dict, scope: Scope, receive: Receive, send: Send) -> None:
    """A direct route's endpoint called as FastAPI would call it (the request, the models the guard let it reach,
    its path's parameters) and its answer or error sent; ``scope["route"]`` set as FastAPI's router sets it (the
    metrics' path label)."""
    scope["route"], scope["path_params"] = route, params
    request = Request(scope, receive)
    try:
        response = await route.endpoint(request=request, known=await known_models(request), **params)
    except Exception as exc:  # every error in its API's shape, as FastAPI's handlers give it
        response = error_answer(request, exc)
    await response(scope, receive, send)


_BODILESS = frozenset(("GET", "HEAD"))  # a body they carry is never read (uvicorn drops it)
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
