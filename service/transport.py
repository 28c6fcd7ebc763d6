"""The HTTP connection layer: uvicorn's httptools protocol with a connection limit and read deadlines.

uvicorn alone lets a client hold a connection forever by trickling its headers or body a byte at a time (its
keep-alive timer only runs between requests, and any byte cancels it), and answers its own refusals in plain text.
Here every connection must deliver its headers within ``header_timeout_s`` and its body within ``body_timeout_s``
(else 408 and the connection is closed), connections beyond ``max_connections`` get a JSON 503 at once, and a
request uvicorn cannot parse gets a JSON 400. Idle keep-alive connections close after ``keep_alive_s``. A deadline
or keep-alive timer that fires with bytes unread in the socket (a stalled loop runs its timers first) lets them be read.
A connection closed while its request body is still arriving (a 413 answered before the body was read) closes
lingering: the answer is sent, the write side is shut, and what still arrives is discarded for up to ``LINGER_S``
(closed at once, the unread data makes the kernel reset the connection, and a client still writing loses its 413).
Pipelined requests are answered in order; a malformed one among them is answered (JSON 400) after every complete
request before it. ``Upgrade`` (websocket, h2c) is never handed off: the request is answered as plain HTTP and the
connection closes after it (one with a body gets a JSON 400: the parser gives the body to the other protocol).
A transfer coding other than ``chunked`` gets a 400 (RFC 9112 6.1 suggests 501; every bad request here is a 4xx).
A client that half-closes (``shutdown(SHUT_WR)``) is gone, as nginx and Go take it: its queued requests are dropped
unrun (499). A head or a chunked trailer section over ``MAX_HEAD_BYTES`` gets a JSON 431 (a 400); trailer fields
are dropped (RFC 9110 6.5.1: never merged into the header section).
Each request's scope carries a ``Disconnect`` (key ``DISCONNECT``) that the connection fires when its client goes
away, so a handler waiting for a model run is cancelled without a task of its own watching ``receive()``.
``addnorm-serve`` passes ``HttpConnection`` to uvicorn (``http=``); worker processes read the same ADDNORM_* settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import termios
from collections import deque

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import raw_error
from service.inference import Disconnect
from service.settings import Settings

LINGER_S = 2.0
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
        self.transport = _Transport(transport, self)  # what uvicorn's request cycles write to and close
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
        if upgrade:  # answered as plain HTTP, then the connection closes (see the module's docstring)
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


class _Transport:
    """The connection's transport as uvicorn sees it. A response's head is held until its body's first write and
    both go out in one system call (uvicorn writes them apart: two sends, two segments for the client to read);
    ``close()`` lingers while a request body (or a refused head) is still arriving (see the module's docstring).
    Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: HttpConnection) -> None:
        self._transport, self._protocol = transport, protocol
        self._lingering, self._head = False, None  # the held response head (bytes), if any

    def write(self, data: bytes) -> None:
        if self._head is not None:  # one writev, no copy of the body
            head, self._head = self._head, None
            self._transport.writelines((head, data))
        elif data[:9] == b"HTTP/1.1 " and data[9:10] != b"1":  # a final response's head (not 100 Continue)
            self._head = data
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a held head (a response without a body: HEAD, 204, 304)."""
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        t, p = self._transport, self._protocol
        if self._lingering or t.is_closing() or not (p.in_body or p.head_refused) or not t.can_write_eof():
            t.close()
            return
        self._lingering = p.discarding = True
        p._disarm()
        t.write_eof()  # after the response already written: the client reads it, then end of stream
        t.resume_reading()  # flow control may have paused reading while the body was not consumed
        p.loop.call_later(LINGER_S, t.close)

    def unread(self) -> bool:
        """Whether bytes not yet read wait in the socket (none when it is closed)."""
        with contextlib.suppress(AttributeError, OSError):
            return fcntl.ioctl(self.get_extra_info("socket").fileno(), termios.FIONREAD, bytes(4)) != bytes(4)
        return False

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)
