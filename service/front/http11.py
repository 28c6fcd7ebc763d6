"""addnorm-serve's HTTP/1.1 connections: the bytes on the socket up to the ASGI app, with the connection's
protections held by the server itself (no proxy needed for any of them).

uvicorn runs the server (its ``http`` option takes this protocol class: lifespan, signals, graceful shutdown and
workers stay uvicorn's), httptools parses, and this module decides what a connection may do:

- a head must be complete within ``header_timeout_s`` of its first byte and within ``MAX_HEAD_BYTES``, else a JSON
  408 / 431 and the connection closes; a new or kept-alive connection that sends nothing for ``keep_alive_s``
  closes silently;
- trailer fields of a chunked body never reach the app: the request is answered as if they were absent (RFC 9110
  section 6.5.1: a trailer must not change how the request is handled; an auth layer that checks the head would not
  see them);
- pipelined requests are answered in order, one at a time, and every complete request before bytes the parser
  rejects is answered before the JSON 400 that closes the connection;
- an answer its client does not read for ``send_timeout_s`` ends the connection; a connection holds at most one
  unread answer (the next pipelined request waits for the last answer to drain), and the unread answers of all
  connections at most ``max_unread_bytes``: past it, the connection holding the most is closed;
- past ``max_connections`` connections or requests in flight, a JSON 503.

The body's own deadline (``body_timeout_s``: a JSON 408) is the app's front's (front/middleware.py), as it must hold
under any ASGI server. Refusals use the API's error shape, ``{"error": ...}``, with the messages of ``REFUSALS``,
which the front proxy (front/nginx_conf.py) answers with too.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
import orjson

from addnorm.service.core.inference import ON_GONE

log = logging.getLogger("addnorm.http")

# Every refusal at the connection, here and by the front proxy (nginx: front/nginx_conf.py), as {"error": message}.
# 494 is nginx's code for a head over its buffers, answered as the 431 RFC 6585 names; 501 for a transfer coding
# it does not know, answered as a 400 (every bad request is a 4xx here).
REFUSALS = {
    400: "malformed HTTP request",
    408: "request not received in time",
    405: "this method is not one HTTP defines",
    413: "request body is above the limit of this server (ADDNORM_MAX_BODY_BYTES)",
    414: "request line is too long",
    431: "the request's head (request line and header fields) is too large",
    494: "the request's head (request line and header fields) is too large",
    501: "Transfer-Encoding is not supported; send chunked or a Content-Length",
    502: "the server behind the proxy is not answering",
    503: "server is at its connection limit (ADDNORM_MAX_CONNECTIONS)",
    504: "the server behind the proxy did not answer in time",
    505: "this HTTP version is not supported: send HTTP/1.1",
}
MAX_TARGET_BYTES = (
    16 * 1024
)  # a request line's target at most 16 KiB (nginx: one of large_client_header_buffers)
MAX_HEAD_BYTES = 72 * 1024  # the whole head at most 72 KiB (nginx: client_header_buffer_size + 4 x 16 KiB)
BODY_HIGH_WATER = 64 * 1024  # a body buffered beyond this stops reading until the app takes it
SWEEP_S = 0.1  # how often the head and idle deadlines are checked: each fires within this much of its time

_STATUS_LINES = {
    code: b"HTTP/1.1 %d %s\r\n" % (code, getattr(http.HTTPStatus(code), "phrase", "").encode())
    for code in (s.value for s in http.HTTPStatus)
}
_NAME_RE = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')  # a token's forbidden bytes (RFC 9110)
_VALUE_RE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_DISCONNECT = {"type": "http.disconnect"}


@dataclass(frozen=True)
class Limits:
    """What a connection may do, from the server's settings (``ADDNORM_*``)."""

    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    send_timeout_s: float = 30.0
    max_connections: int = 1000
    max_unread_bytes: int = 256 * 1024 * 1024

    @classmethod
    def of(cls, settings: Any) -> Limits:
        return cls(
            header_timeout_s=settings.header_timeout_s,
            keep_alive_s=settings.keep_alive_s,
            send_timeout_s=settings.send_timeout_s,
            max_connections=settings.max_connections,
            max_unread_bytes=settings.max_unread_bytes,
        )


def limits_of(app: Any) -> Limits:
    """The limits of addnorm's app (``create_app``: its settings); the defaults for any other ASGI app."""
    state = getattr(getattr(app, "state", None), "addnorm", None)
    return Limits.of(state.settings) if state is not None else Limits()


def refusal(status: int, message: str | None = None, close: bool = True) -> bytes:
    """A whole JSON answer, as bytes, with the API's error shape."""
    body = orjson.dumps({"error": message or REFUSALS[status]})
    return b"".join(
        (
            _STATUS_LINES.get(status, b"HTTP/1.1 %d \r\n" % status),
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n" if close else b"\r\n",
            body,
        )
    )


class _Refused(Exception):
    """Raised in a parser callback: the connection answers ``status`` (after the requests before it) and closes."""

    def __init__(self, status: int, message: str | None = None) -> None:
        super().__init__(message or REFUSALS[status])
        self.status, self.message = status, message or REFUSALS[status]


class Http11(asyncio.Protocol):
    """One HTTP/1.1 connection (uvicorn's ``http`` option: uvicorn makes one per connection with its config and
    server state, and calls ``shutdown`` to drain it). See the module's docstring for what it enforces."""

    # The unread answers of every connection, for ``max_unread_bytes`` (one server per process).
    _paused: set[Http11] = set()
    # Every open connection, whose deadlines one sweep checks.
    _open: set[Http11] = set()
    _sweeping: asyncio.AbstractEventLoop | None = None  # the loop a sweep is scheduled on

    def __init__(
        self, config: Any, server_state: Any, app_state: dict | None = None, _loop: Any = None
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.limits = limits_of(self.app)
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state, self.app_state = server_state, app_state or {}
        self.root_path = config.root_path
        self.parser = httptools.HttpRequestParser(self)
        # A request after one that asked to close is not read, not refused (its predecessor is answered).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport | None = None
        self.server: tuple | None = None
        self.client: tuple | None = None
        self.running: _Cycle | None = None  # the request whose app runs
        self.pending: deque[_Cycle] = deque()  # complete heads pipelined behind it
        self.parsing: _Cycle | None = None  # the request whose body is being read (running or pending)
        self.closing = False  # no more requests are read: answer those received, then close
        self.final: bytes | None = None  # what is written after the last answer, before closing (a refusal)
        self.reading = True
        self.write_paused = False
        self.drained: list[asyncio.Future] = []
        # idle, or the head's deadline: when (the loop's clock; 0: none) and what then. One sweep a server checks
        # every connection's (``_sweep``): a timer per request (armed and cancelled twice a request) cost more.
        self.due = 0.0
        self.late: Any = None
        self.send_timer: asyncio.TimerHandle | None = None
        # the request being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.in_head = False  # a head has begun and is not complete
        self.in_trailers = False
        self.expect_100 = False

    # -- the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)
        Http11._open.add(self)
        if Http11._sweeping is not self.loop:
            Http11._sweeping = self.loop
            self.loop.call_later(SWEEP_S, Http11._sweep, self.loop)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self._arm(self.limits.keep_alive_s, self._idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        Http11._open.discard(self)
        Http11._paused.discard(self)
        self._disarm()
        if self.send_timer is not None:
            self.send_timer.cancel()
        for cycle in (self.running, *self.pending):
            if cycle is not None:
                cycle.gone()
        self.pending.clear()
        self._wake_writers()
        self.parser = None  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade()
        except httptools.HttpParserError as exc:
            cause = (
                exc.__context__
            )  # httptools raises a callback's exception as a callback error, with it as context
            if isinstance(cause, _Refused):
                self._refuse(cause.status, cause.message)
            else:
                if cause is not None and not isinstance(cause, httptools.HttpParserError | UnicodeError):
                    log.error("the HTTP parser's callback failed", exc_info=cause)
                    self._refuse(400)
                else:  # the parser's own reason, e.g. "Content-Length can't be present with Transfer-Encoding"
                    self._refuse(400, f"{REFUSALS[400]}: {str(cause or exc)[:200]}")

    def pause_writing(self) -> None:
        self.write_paused = True
        self.send_timer = self.loop.call_later(self.limits.send_timeout_s, self._not_reading)
        Http11._paused.add(self)
        self._bound_unread()

    def resume_writing(self) -> None:
        self.write_paused = False
        Http11._paused.discard(self)
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None
        self._wake_writers()
        if self.running is None and not self.transport.is_closing():
            self._next()  # a pipelined request waited for this answer to drain

    def shutdown(self) -> None:
        """The server drains: what was received is answered, then the connection closes."""
        self.closing = True
        self._flow()
        if self.running is None and not self.pending:
            self.transport.close()

    # -- the parser's callbacks

    def on_message_begin(self) -> None:
        self.url, self.headers, self.head_bytes = b"", [], 0
        self.in_trailers = self.expect_100 = False
        self.in_head = True
        # the idle deadline becomes the head's, from its first byte
        self._arm(self.limits.header_timeout_s, self._head_late)

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_TARGET_BYTES:
            raise _Refused(414)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_trailers:
            # A trailer field: never seen by the app (RFC 9110 6.5.1). The request is answered as if it were absent.
            log.debug("trailer field %r dropped", name[:64])
            return
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes + len(self.url) > MAX_HEAD_BYTES:
            raise _Refused(431)
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100 = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._disarm()
        self.in_head = False
        self.in_trailers = True
        parser = self.parser
        for name, value in self.headers:
            if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
                raise _Refused(400, REFUSALS[501])
        version = parser.get_http_version()
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": self.root_path,
            "path": self.root_path + path,
            "raw_path": self.root_path.encode("ascii") + raw_path,
            "query_string": url.query or b"",
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        cycle = _Cycle(self, scope, keep_alive, self.expect_100)
        scope["extensions"] = {ON_GONE: cycle.on_gone}
        self.parsing = cycle
        if self._over_limit():
            log.warning("HTTP request refused: %s", REFUSALS[503])
            cycle.app = _at_limit
        if self.running is None and not self.pending:
            self._start(cycle)
        else:
            self.pending.append(cycle)  # pipelined: runs once the ones before it are answered
        self._flow()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is not None and not (cycle.gone_ or cycle.complete):  # else dropped: it was answered already
            cycle.body += body
            cycle.wake()
            if len(cycle.body) > BODY_HIGH_WATER:
                self._flow()

    def on_message_complete(self) -> None:
        cycle, self.parsing = self.parsing, None
        if cycle is not None:
            cycle.more_body = False
            cycle.wake()
        self._flow()

    # -- requests and answers

    def _start(self, cycle: _Cycle) -> None:
        self.running = cycle
        tasks = self.server_state.tasks
        task = self.loop.create_task(cycle.run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def answered(self, cycle: _Cycle) -> None:
        """``cycle``'s answer is written whole: the next pipelined request runs (once it drained), or the
        connection idles, or closes."""
        self.server_state.total_requests += 1
        if self.running is cycle:
            self.running = None
        if not cycle.keep_alive:
            self.closing = True
            self.pending.clear()
            self.transport.close()
            return
        if not self.write_paused:
            self._next()

    def _next(self) -> None:
        if self.pending:
            self._start(self.pending.popleft())
        elif self.final is not None:
            self.transport.write(self.final)
            self.transport.close()
        elif self.closing:
            self.transport.close()
        elif self.parsing is None and not self.in_head:
            self._arm(self.limits.keep_alive_s, self._idle)
        self._flow()

    def _refuse(self, status: int, message: str | None = None) -> None:
        """Stop reading; answer every request received whole, then ``status`` in its JSON shape, and close. A request
        whose body the refused bytes broke is never run (or, already running, sees its client gone)."""
        log.info(
            "HTTP connection from %s refused: %d %s", _peer(self.client), status, message or REFUSALS[status]
        )
        self.closing = True
        self._disarm()
        self.final = refusal(status, message)
        broken, self.parsing = self.parsing, None
        if broken is not None and not broken.complete:
            if broken in self.pending:
                self.pending.remove(broken)
            else:
                broken.gone()  # running: its app sees its client gone; the refusal follows once it ends
        self._flow()
        if self.running is None and not self.pending:
            self._next()

    def _upgrade(self) -> None:
        """An Upgrade (websocket, h2c) is never taken: the request is answered as plain HTTP without a body (what
        follows its head is the other protocol's), then the connection closes."""
        self.closing = True
        cycle, self.parsing = self.parsing, None
        if cycle is not None:
            cycle.more_body = False
            cycle.wake()
        last = self.pending[-1] if self.pending else self.running
        if last is not None and not last.started:
            last.keep_alive = False  # its answer says the connection closes
        self._flow()

    def _over_limit(self) -> bool:
        limit = self.limits.max_connections
        return len(self.server_state.connections) > limit or len(self.server_state.tasks) >= limit

    # -- reading, writing and timers

    def _flow(self) -> None:
        """Read while a request could use more bytes: none pipelined waiting, its body's buffer not full."""
        parsing = self.parsing
        want = not (
            self.closing
            or self.pending
            or (parsing is not None and not parsing.complete and len(parsing.body) > BODY_HIGH_WATER)
        )
        if want != self.reading and not self.transport.is_closing():
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    async def drain(self) -> None:
        waiter = self.loop.create_future()
        self.drained.append(waiter)
        await waiter

    def _wake_writers(self) -> None:
        for waiter in self.drained:
            if not waiter.done():
                waiter.set_result(None)
        self.drained.clear()

    def _arm(self, seconds: float, then: Any) -> None:
        self.due, self.late = self.loop.time() + seconds, then

    def _disarm(self) -> None:
        self.due = 0.0

    @classmethod
    def _sweep(cls, loop: asyncio.AbstractEventLoop) -> None:
        """Every ``SWEEP_S`` while connections are open: each one past its deadline is told (``late``)."""
        now = loop.time()
        for conn in [c for c in cls._open if 0.0 < c.due <= now]:
            conn.due = 0.0
            try:
                if not conn.transport.is_closing():
                    conn.late()
            except Exception:  # never the sweep: every other connection's deadline depends on it
                log.exception("a connection's deadline failed")
                conn.transport.abort()
        if cls._open and cls._sweeping is loop:
            loop.call_later(SWEEP_S, cls._sweep, loop)
        elif cls._sweeping is loop:
            cls._sweeping = None

    def _idle(self) -> None:
        if self.running is None and not self.pending and self.parsing is None and not self.in_head:
            self.transport.close()

    def _head_late(self) -> None:
        self._refuse(408)

    def _not_reading(self) -> None:
        self.send_timer = None
        log.info(
            "HTTP connection from %s closed: its client read nothing of its answer for %g s (ADDNORM_SEND_TIMEOUT_S)",
            _peer(self.client),
            self.limits.send_timeout_s,
        )
        self.transport.abort()

    def _bound_unread(self) -> None:
        """The answers no client reads, all connections together, at most ``max_unread_bytes``: past it, the
        connection holding the most is closed."""
        held = {conn: conn.transport.get_write_buffer_size() for conn in Http11._paused}
        total = sum(held.values())
        while total > self.limits.max_unread_bytes and held:
            conn = max(held, key=held.__getitem__)
            total -= held.pop(conn)
            Http11._paused.discard(conn)
            log.warning(
                "HTTP connection from %s closed: %d bytes of answers unread, %d in all (ADDNORM_MAX_UNREAD_BYTES)",
                _peer(conn.client),
                held.get(conn, 0),
                total,
            )
            conn.transport.abort()


class _GoneWatch:
    """What ``_Cycle.on_gone`` returns: ``cancel`` drops the callback (the request ended)."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: _Cycle) -> None:
        self.cycle = cycle

    def cancel(self) -> None:
        self.cycle.gone_callback = None


class _Cycle:
    """One request on a connection: its scope, its body as it arrives, its answer as the app sends it."""

    __slots__ = (
        "conn",
        "scope",
        "keep_alive",
        "expect_100",
        "app",
        "body",
        "more_body",
        "delivered",
        "waiter",
        "gone_",
        "started",
        "complete",
        "chunked",
        "remaining",
        "head",
        "gone_callback",
    )

    def __init__(self, conn: Http11, scope: dict, keep_alive: bool, expect_100: bool) -> None:
        self.conn, self.scope, self.keep_alive, self.expect_100 = conn, scope, keep_alive, expect_100
        self.app = conn.app
        self.body = bytearray()
        self.more_body = True
        self.delivered = False  # the body's last message was given to the app
        self.waiter: asyncio.Future | None = None
        self.gone_ = False  # the client went away (or the request's bytes broke)
        self.started = self.complete = False
        self.chunked: bool | None = None
        self.remaining = 0
        self.head = b""
        self.gone_callback: Callable[[], object] | None = None  # on_gone's

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def gone(self) -> None:
        self.gone_ = True
        self.wake()
        if (callback := self.gone_callback) is not None:
            self.gone_callback = None
            callback()

    def on_gone(self, callback: Callable[[], object]) -> _GoneWatch:
        """The scope's ``ON_GONE`` extension: ``callback`` once the client has gone away (at once if it has); the
        watch returned cancels it (one watch a request)."""
        if self.gone_:
            callback()
        else:
            self.gone_callback = callback
        return _GoneWatch(self)

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("the app failed on %s %s", self.scope["method"], self.scope["path"], exc_info=exc)
            if not self.started and not self.gone_:
                self._finish(refusal(500, "internal error", close=True))
            elif not self.complete:
                self.conn.transport.close()
            if not isinstance(exc, Exception):
                raise
        else:
            if not self.complete and not self.gone_:
                log.error(
                    "the app ended without a whole answer to %s %s", self.scope["method"], self.scope["path"]
                )
                if not self.started:
                    self._finish(refusal(500, "internal error", close=True))
                else:
                    self.conn.transport.close()
        finally:
            self.body.clear()
            if not self.complete:  # never answered: its client left, or its bytes broke (a refusal follows)
                self.complete = True
                conn = self.conn
                if conn.running is self:
                    conn.running = None
                if not conn.transport.is_closing():
                    conn._next()

    def _finish(self, whole: bytes) -> None:
        self.started = self.complete = True
        self.keep_alive = False
        self.conn.transport.write(whole)
        self.conn.answered(self)

    async def receive(self) -> dict:
        if self.expect_100:
            self.expect_100 = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self.gone_ or self.complete:
                return _DISCONNECT
            if self.body or (not self.more_body and not self.delivered):
                body = bytes(self.body)
                self.body.clear()
                self.delivered = not self.more_body
                if self.conn.parsing is self:
                    self.conn._flow()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            if self.conn.parsing is self:
                self.conn._flow()
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def send(self, message: dict) -> None:
        conn = self.conn
        if conn.write_paused and not self.gone_:
            await conn.drain()
        if self.gone_ or conn.transport.is_closing():
            return  # nobody to answer: run's end lets the next request (or the refusal) go
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self.started = True
            self.expect_100 = False
            self.head = self._head(message["status"], message.get("headers", ()))
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r} after the answer's start or end")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            data = b""
            self.remaining = 0
        elif self.chunked:
            data = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        else:
            if len(body) > self.remaining:
                raise RuntimeError("the answer is longer than its Content-Length")
            self.remaining -= len(body)
            data = body
        head, self.head = self.head, b""
        if head and len(data) < 65536:
            conn.transport.write(head + data)  # one write: one segment for a small answer
        else:
            if head:
                conn.transport.write(head)
            if data:
                conn.transport.write(data)
        if not more:
            if self.remaining:
                raise RuntimeError("the answer is shorter than its Content-Length")
            self.complete = True
            if not self.keep_alive:
                conn.transport.close()
            self.wake()
            conn.answered(self)

    def _head(self, status: int, headers: Any) -> bytes:
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        for name, value in self.conn.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        close = False
        for name, value in headers:
            if _NAME_RE.search(name) or _VALUE_RE.search(value):
                raise RuntimeError(f"invalid header field in the answer: {name!r}")
            name = name.lower()
            if name == b"content-length" and self.chunked is None:
                self.remaining, self.chunked = int(value), False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.remaining, self.chunked = 0, True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive, close = False, True
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            parts.append(b"connection: close\r\n")
        if self.chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


async def _at_limit(scope: dict, receive: Any, send: Any) -> None:
    body = orjson.dumps({"error": REFUSALS[503]})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"retry-after", b"1"),
    ]
    await send(
        {"type": "http.response.start", "status": 503, "headers": [*headers, (b"connection", b"close")]}
    )
    await send({"type": "http.response.body", "body": body})


def _address(value: Any) -> tuple | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None


def _peer(client: tuple | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"
