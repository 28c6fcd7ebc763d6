"""Request plumbing the HTTP protocols share: bounded body reads, disconnect-aware inference, timing headers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from service.batcher import Outputs, Timings
from service.errors import BadInput, ClientGone, TooLarge
from service.state import LoadedState, ServingModel
from service.transport import DISCONNECT, Disconnect

T = TypeVar("T")


OFFLOAD_BYTES = 256 * 1024  # below this, decoding or encoding is cheaper than a thread hop


async def offload(nbytes: int, fn: Callable[..., T], *args: object) -> T:
    """Run a CPU-bound codec step in a worker thread when it is big enough to stall the event loop."""
    if nbytes > OFFLOAD_BYTES:
        return await run_in_threadpool(fn, *args)
    return fn(*args)


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


async def infer(
    request: Request,
    loaded: LoadedState,
    model: ServingModel,
    x: np.ndarray,
    mask: np.ndarray | None,
    timeout_s: float | None = None,
) -> tuple[Outputs, Timings]:
    """Queue a decoded batch (the codecs validated it against the model); drop it if its client goes away.

    ``timeout_s`` (a client's own deadline) can only shorten the server's ADDNORM_REQUEST_TIMEOUT_S.
    """
    limit = loaded.settings.request_timeout_s
    timeout = limit if timeout_s is None else min(timeout_s, limit)
    handler = asyncio.current_task()
    if handler is None:  # not reachable from a request; keeps the type checker honest
        raise RuntimeError("infer() must run inside a request's task")
    disconnect = request.scope.get(DISCONNECT)
    if disconnect is None:  # another ASGI server (Ray Serve's, a test client): watch receive() instead
        disconnect = Disconnect()
        watch = asyncio.ensure_future(_watch_receive(request, disconnect))
    else:
        watch = None
    if disconnect.gone:
        raise ClientGone
    disconnect.notify(handler.cancel)
    try:
        return await model.batcher.infer(x, mask, timeout)
    except asyncio.CancelledError:
        if disconnect.gone:  # cancelled because the client went away, not by a shutdown
            raise ClientGone from None
        raise
    finally:
        disconnect.notify(None)
        if watch is not None:
            watch.cancel()


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
