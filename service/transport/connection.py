"""One HTTP connection's reading side: limits, deadlines, parsing, pipelining (the package's docstring)."""

from __future__ import annotations

import asyncio
import functools
import typing
from collections import deque

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.errors import raw_error
from service.inference import Disconnect
from service.settings import Settings
from service.transport.writing import ConnectionWriter, respond

GRACE_S = 1.0  # a deadline that fired with the request's bytes unread: they are read, then it holds again
# A request's head (request line and header fields) may be this long, and so may a chunked body's trailer section;
# beyond it 431 (400 for a trailer) and the connection closes. nginx allows 4 x 8 KiB by default, Go 1 MiB.
MAX_HEAD_BYTES = 64 * 1024
_LONG_HEAD = f"the request's head (request line and header fields) is over {MAX_HEAD_BYTES} bytes"
DISCONNECT = "addnorm.disconnect"  # the scope key of a request's Disconnect
_NO_UPGRADE = (
    "this server speaks HTTP/1.1 and does not switch protocols: send the request without 'Connection: "
    "Upgrade' (curl: --http1.1 instead of --http2; gRPC has its own port)"
)


class HttpConnection(HttpToolsProtocol):
    """One connection. The limits are class attributes, set from the settings by ``configure``."""

    max_connections: int | None = None
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    _configured = False

    @classmethod
    def configure(cls, settings: Settings) -> None:
        cls.max_connections = settings.max_connections
        cls.header_timeout_s = settings.header_timeout_s
        cls.body_timeout_s = settings.body_timeout_s
        cls._configured = True

    def __init__(self, *args, **kwargs) -> None:
        if not HttpConnection._configured:  # a worker process: its settings come from the environment
            HttpConnection.configure(Settings())
        super().__init__(*args, **kwargs)
        # The connection's one deadline (headers, or body): its timer is made only when a read ends with it still
        # pending, so a request read whole in one segment (the usual case) arms and disarms it without a timer.
        self._deadline_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_headers, self._graced = True, False  # a headers' deadline; not extended (``_expired``)
        self.in_body = False  # between a request's headers and the end of its body
        self.discarding = False  # lingering: input is read and dropped until the socket closes
        self._unanswered: deque[Disconnect] = deque()  # requests read and not yet answered, oldest first
        self._reading = True  # False once the input can no longer be parsed (an error, an upgrade's tail)
        self._refusal: tuple[int, str] | None = None  # what a parser callback refused the request with
        self._deferred: tuple[int, str] | None = None  # a refusal waiting for the answers before it
        # The current request's head so far: its parsed parts exactly (URL, complete fields), the bytes read for it
        # while unfinished (with a field the parser still holds), and its trailer section's fields.
        self._head_fields = self._head_raw = self._trailer_bytes = 0
        self._began = False  # a request began during the read being parsed
        self.head_refused = False  # refused before its head ended: the client may still be sending it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = ConnectionWriter(transport, self)  # what uvicorn's request cycles write to and close
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            msg = f"server is at its connection limit ({self.max_connections}: ADDNORM_MAX_CONNECTIONS)"
            return self._refuse(503, msg, retry_after=1)
        self._arm(self.header_timeout_s, headers=True)
        self._start_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.in_body = False
        super().connection_lost(exc)
        while self._unanswered:  # the running request and any pipelined behind it
            self._unanswered.popleft().fire()

    def data_received(self, data: bytes) -> None:
        if self._reading and not self.discarding:
            self._began = False
            super().data_received(data)  # the parser's callbacks below arm and disarm the deadline
            if self._in_headers and self._reading:  # a head still unfinished
                # all of this read went to it, unless it began in this read (then what was parsed of it)
                self._head_raw = self._head_fields if self._began else self._head_raw + len(data)
                if self._head_raw > MAX_HEAD_BYTES:
                    self._refusal, self.head_refused = (431, _LONG_HEAD), True
                    self.send_400_response("")
                    return
            self._start_timer()

    def eof_received(self) -> None:
        if self.discarding:  # the client finished sending: nothing left to drop
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_fields = self._head_raw = self._trailer_bytes = 0
        self._began = True
        self._arm(self.header_timeout_s, headers=True)

    def on_url(self, url: bytes) -> None:
        self._head_fields += len(url)
        if self._head_fields > MAX_HEAD_BYTES:
            self._stop(431, _LONG_HEAD)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_body:
            self._head_fields += len(name) + len(value) + 4
            if self._head_fields > MAX_HEAD_BYTES:
                self._stop(431, _LONG_HEAD)
            super().on_header(name, value)
            return
        # a trailer field (the parser reports them like header fields, after the body): counted and dropped
        self._trailer_bytes += len(name) + len(value) + 4
        if self._trailer_bytes > MAX_HEAD_BYTES:
            self._stop(400, f"the request's trailer section is over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        codings = [
            t.strip().lower() for k, v in self.headers if k == b"transfer-encoding" for t in v.split(b",")
        ]
        if codings and codings != [b"chunked"]:
            shown = ", ".join(c.decode("latin-1") for c in codings)[:200]
            self._stop(400, f"Transfer-Encoding {shown!r} is not supported; send chunked or a Content-Length")
        upgrade = self.parser.should_upgrade()
        if upgrade and (
            codings or any(k == b"content-length" and v.strip() != b"0" for k, v in self.headers)
        ):
            self._stop(400, _NO_UPGRADE)  # the parser gives what follows the headers to the new protocol
        self.scope[DISCONNECT] = disconnect = Disconnect()  # the scope the request's cycle is built on, next
        super().on_headers_complete()
        self._unanswered.append(disconnect)
        if upgrade:  # answered as plain HTTP, then the connection closes (see the package's docstring)
            self.cycle.keep_alive = False
        self.in_body = True
        self._arm(self.body_timeout_s, headers=False)

    def _stop(self, status: int, message: str) -> None:
        """Refuse the request from a parser callback: the parser stops, and ``send_400_response`` answers."""
        self._refusal, self.head_refused = (status, message), self._in_headers
        raise ValueError(message)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_body = False
        self._disarm()

    def on_response_complete(self) -> None:
        self.transport.flush()  # a response without a body wrote only its head
        if self._unanswered:  # requests are answered in the order they came (pipelining included)
            self._unanswered.popleft()
        super().on_response_complete()
        if self._deferred is not None and not self._unanswered:
            (status, message), self._deferred = self._deferred, None
            self._refuse(status, message)

    def send_400_response(self, msg: str) -> None:
        """The parser stopped: answer the refusal a callback made, else 400; after the complete requests before
        it, when some are still unanswered (pipelining)."""
        status, message = self._refusal or (400, f"malformed HTTP request: {msg}")
        self._refusal, self._reading = None, False
        wait = bool(self._unanswered)  # complete requests before the bad one still to answer
        if self.in_body:  # the bad request's body broke: it was read in part
            queued = bool(self.pipeline) and self.pipeline[0][0] is self.cycle  # behind others: it never runs
            if queued:
                self.pipeline.popleft()
                self._unanswered.pop()
            wait, self.in_body = queued and bool(self._unanswered), False  # running: nothing before it waits
        if not wait:
            return self._refuse(status, message)
        self._deferred = (status, message)
        self._disarm()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: typing.Any) -> None:
        # A fast route's request is answered by one call, no ASGI messages (app.direct: guard.HttpFront.direct).
        direct = getattr(app, "direct", None)
        run = direct and direct(cycle.scope, cycle.receive, functools.partial(respond, cycle))
        super()._start_asgi_task(cycle, app if run is None else lambda *_: run)

    def _should_upgrade(self) -> bool:
        return False  # no protocol switch, ever: the request is answered as HTTP (uvicorn would hand it off)

    def _unsupported_upgrade_warning(self) -> None:
        self._reading = False  # what follows an upgrade request is the other protocol's: not HTTP to parse

    def _arm(self, seconds: float, headers: bool) -> None:
        self._disarm()
        self._in_headers, self._graced = headers, False
        self._deadline_at = self.loop.time() + seconds

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._deadline_at = self._timer = None

    def _start_timer(self) -> None:
        """A timer for a deadline still pending once the data at hand is read (see ``__init__``)."""
        if self._deadline_at is not None and self._timer is None:
            self._timer = self.loop.call_at(self._deadline_at, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if not self._graced and self.transport.unread():
            # a loop stalled past the deadline runs due timers before it reads: what came is read first (once)
            self._graced, self._timer = True, self.loop.call_later(GRACE_S, self._expired)
            return
        self._deadline_at = None
        if self._in_headers:
            self._refuse(408, f"request headers not received within {self.header_timeout_s:g} s")
        else:  # the app is reading the body: closing makes its receive() report a disconnect
            self.logger.info("closing connection whose body did not arrive within %g s", self.body_timeout_s)
            self.transport.close()

    def _refuse(self, status: int, message: str, retry_after: int | None = None) -> None:
        self._disarm()
        # a closing transport was already answered and closed (a response without keep-alive)
        if not self.transport.is_closing():
            self.transport.write(raw_error(status, message, retry_after))
            self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.unread():  # else the next request came and a stalled loop has yet to read it
            super().timeout_keep_alive_handler()
