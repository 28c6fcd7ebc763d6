"""Request plumbing the HTTP protocols share: bounded body reads, the request core's Call for an HTTP request,
timing headers."""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from service.batcher import Timings
from service.errors import BadInput, ClientGone, TooLarge
from service.inference import Call
from service.transport import DISCONNECT, Disconnect


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing more than ``max_bytes`` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadInput("Content-Length is not a number") from None
        if size > max_bytes:
            raise TooLarge(
                f"request body of {size} bytes is above the limit of {max_bytes} (ADDNORM_MAX_BODY_BYTES)"
            )
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise TooLarge(
                    f"request body is above the limit of {max_bytes} bytes (ADDNORM_MAX_BODY_BYTES)"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def http_call(request: Request, protocol: str, started: float, named: str | None = None) -> Call:
    """The request core's view of an HTTP request whose body has been read: its client going away is the
    transport's Disconnect (service/transport.py), or, under another ASGI server (Ray Serve's, a test client), a
    watch on receive() that the core stops when the request ends."""
    gone, watch = request.scope.get(DISCONNECT), None
    if gone is None:
        gone = Disconnect()
        watch = asyncio.ensure_future(_watch_receive(request, gone))
    carrier = request.headers.get
    return Call(protocol, named=named, started=started, gone=gone, carrier=carrier, watch=watch)


async def _watch_receive(request: Request, disconnect: Disconnect) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    disconnect.fire()


def timing_headers(timings: Timings, total_s: float) -> dict[str, str]:
    """Server-Timing plus plain headers, in milliseconds."""
    q, i, t = timings.queue_s * 1e3, timings.infer_s * 1e3, total_s * 1e3
    return {
        "Server-Timing": f"queue;dur={q:.3f}, infer;dur={i:.3f}, total;dur={t:.3f}",
        "X-Queue-Time-Ms": f"{q:.3f}",
        "X-Inference-Time-Ms": f"{i:.3f}",
        "X-Total-Time-Ms": f"{t:.3f}",
    }


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def error_docs(descriptions: dict[int, str]) -> dict[str, dict]:
    """OpenAPI ``responses`` entries for errors, each a JSON ``{"error": ...}`` body."""
    content = {"application/json": {"schema": ERROR_SCHEMA}}
    return {str(code): {"description": text, "content": content} for code, text in descriptions.items()}
