"""The HTTP connection layer: uvicorn's httptools protocol with a connection limit and read deadlines.

uvicorn alone lets a client hold a connection forever by trickling its headers or body a byte at a time (its
keep-alive timer only runs between requests, and any byte cancels it), and answers its own refusals in plain text.
Here every connection must deliver its headers within ``header_timeout_s`` and its body within ``body_timeout_s``
(else 408 and the connection is closed), connections beyond ``max_connections`` get a JSON 503 at once, and a
request uvicorn cannot parse gets a JSON 400. Idle keep-alive connections close after ``keep_alive_s``.

``addnorm-serve`` passes ``Protocol`` to uvicorn (``http=``); worker processes read the same ADDNORM_* settings.
"""

from __future__ import annotations

import asyncio

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.settings import Settings

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def raw_error(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response with the API's JSON body, for answers written before any app runs."""
    body = orjson.dumps({"error": message})
    head = [
        b"HTTP/1.1 %d %s" % (status, _REASONS[status]),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
    ]
    if retry_after is not None:
        head.append(b"retry-after: %d" % retry_after)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class Protocol(HttpToolsProtocol):
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

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if not Protocol._configured:  # a worker process: the CLI passed its settings through the environment
            Protocol.configure(Settings())
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            limit = self.max_connections
            self._refuse(
                503, f"server is at its connection limit ({limit}: ADDNORM_MAX_CONNECTIONS)", retry_after=1
            )
            return
        self._arm(self.header_timeout_s, headers=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s, headers=True)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout_s, headers=False)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg}")

    def _arm(self, seconds: float, headers: bool) -> None:
        self._disarm()
        self._in_headers = headers
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_headers:
            self._refuse(408, f"request headers not received within {self.header_timeout_s:g} s")
        else:  # the app is reading the body: closing makes its receive() report a disconnect
            self.logger.info(
                "closing a connection whose body did not arrive within %g s", self.body_timeout_s
            )
            self.transport.close()

    def _refuse(self, status: int, message: str, retry_after: int | None = None) -> None:
        self._disarm()
        self.transport.write(raw_error(status, message, retry_after))
        self.transport.close()
