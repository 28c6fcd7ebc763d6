"""One HTTP connection's writing side: what uvicorn's request cycles write through (``ConnectionWriter``: a
response's head and body in one system call, the lingering close) and a fast route's whole answer written at once
(``respond``: service.guard.HttpFront.direct).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import termios
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

LINGER_S = 2.0  # a connection closed while its request body still arrives discards it this long, then closes


class ConnectionWriter:
    """The connection's transport as uvicorn sees it. A response's head is held until its body's first write and
    both go out in one system call (uvicorn writes them apart: two sends, two segments for the client to read);
    ``close()`` lingers while a request body (or a refused head) is still arriving (see the package's docstring).
    Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:  # its HttpConnection
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


async def respond(
    cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """A whole answer in one write, as uvicorn's ``send`` writes one from its two messages, with its effects on the
    connection (``Connection: close``, the next pipelined request) and its wait for a client that reads slower than
    it is answered. The headers are the server's own."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started, cycle.waiting_for_100_continue = True, False
    lines = [STATUS_LINE[status], *(b"%s: %s\r\n" % kv for kv in (*cycle.default_headers, *headers))]
    if any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers):
        cycle.keep_alive = False
    elif not cycle.keep_alive:
        lines.append(b"connection: close\r\n")
    cycle.transport.writelines((b"".join(lines) + b"\r\n", body))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
