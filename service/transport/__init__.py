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
The reading side is ``connection.py`` (``HttpConnection``), the writing side ``writing.py`` (``ConnectionWriter``,
and ``respond``: a fast route's whole answer in one write, service.guard.HttpFront.direct).
"""

from service.transport.connection import DISCONNECT, GRACE_S, MAX_HEAD_BYTES, HttpConnection
from service.transport.writing import LINGER_S, ConnectionWriter, respond

__all__ = [
    "DISCONNECT",
    "GRACE_S",
    "LINGER_S",
    "MAX_HEAD_BYTES",
    "ConnectionWriter",
    "HttpConnection",
    "respond",
]
