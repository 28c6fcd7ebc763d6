"""What the protocols share: bounded body reads (with their Content-Encoding undone), the request core's Call for
an HTTP request, timing headers; and validation: JSON bodies, and decoded (B, S, E) batches against the model.
"""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import orjson
from fastapi import Request

from addnorm.model.contract import EMBEDDINGS, MASK
from addnorm.service.backend.engine import TRIM_BODY_BYTES, trim_later
from addnorm.service.batching.merging import Outputs, Timings
from addnorm.service.core.inference import OFFLOAD_BYTES, ON_GONE, Call, Disconnect, Infer
from addnorm.service.core.text import TextRequest
from addnorm.service.errors import BadInput, ClientGone, TooLarge, UnsupportedMediaType, quote
from addnorm.service.metrics import RequestTimer

_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def content_coding(value: str | None) -> str | None:
    """The body's content coding, from its Content-Encoding: None for none or identity, else gzip or deflate
    (tritonclient's request_compression_algorithm). Codings are case-insensitive and x-gzip is gzip (RFC 9110
    8.4.1); any other, or more than one, is 415: a body in a coding this server cannot undo is never read as if
    it were plain."""
    if value is None:
        return None
    codings = [c for c in (t.strip().lower() for t in value.split(",")) if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in _CODINGS:
        raise UnsupportedMediaType(f"unsupported Content-Encoding {quote(value)}; use gzip, deflate or none")
    return codings[0]


def inflate(body: bytes, coding: str, max_bytes: int) -> bytes:
    """Undo a gzip or deflate body, refusing more than ``max_bytes`` out. Every gzip member is read (RFC 1952
    2.2: a gzip file may be several members, which ``gzip -d`` joins); anything after the end that is not
    another member is refused, never dropped."""
    parts, total, data, member = [], 0, body, 0
    while True:
        d = zlib.decompressobj(_CODINGS[coding])
        member += 1
        where = f" (member {member})" if member > 1 else ""
        try:
            part = d.decompress(data, max_bytes + 1 - total)
        except zlib.error as exc:
            raise BadInput(f"body is not valid {coding} data{where}: {exc}") from None
        total += len(part)
        if total > max_bytes:
            raise TooLarge(
                f"decompressed body is above the limit of {max_bytes} bytes (ADDNORM_MAX_BODY_BYTES)"
            )
        if not d.eof:
            raise BadInput(f"body is truncated {coding} data{where}")
        parts.append(part)
        data = d.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if coding == "deflate":
            raise BadInput(f"{len(data)} byte(s) follow the end of the deflate data")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, its Content-Encoding undone (415 for one not supported, before reading), refusing
    more than ``max_bytes`` before reading it all, and more than ``max_bytes`` once inflated."""
    coding = content_coding(request.headers.get("content-encoding"))
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
    chunks, total, more = [], 0, True
    while more:  # ASGI's messages themselves: an async iterator per request was a measurable cost (bench/)
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(chunk := message.get("body", b""))
        total, more = total + len(chunk), message.get("more_body", False)
        if total > max_bytes:
            raise TooLarge(f"request body is above the limit of {max_bytes} bytes (ADDNORM_MAX_BODY_BYTES)")
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if total >= TRIM_BODY_BYTES:
        trim_later()  # its buffers are freed once it is answered: the heap gives them back
    if coding is None:
        return body
    if len(body) > OFFLOAD_BYTES // 4:  # zlib lets go of the GIL: off the event loop, a thread inflates it
        return await asyncio.to_thread(inflate, body, coding, max_bytes)
    return inflate(body, coding, max_bytes)


def direct(endpoint):
    """Marks a route's endpoint for the HTTP front's direct lane (``front.middleware.Front``): the front calls it
    itself, without FastAPI's router, exception middleware and dependency solving, which cost a small request more
    of the event loop than its own handling (docs/benchmarks.md). It stays a FastAPI route, declared once with its
    OpenAPI entry, and is served the same either way; its parameters may only be ``request: Request``,
    ``known: Known`` and its path's own parameters (strings), which is what the front passes (by name)."""
    endpoint.direct = True
    return endpoint


def http_call(request: Request, protocol: str, started: float, named: str | None = None) -> Call:
    """The request core's view of an HTTP request. Its client going away is seen once its body has been read
    (``read_then_watch``) by a watch on ``receive()`` (ASGI's ``http.disconnect``), which the core stops when the
    request ends."""
    return Call(protocol, named=named, started=started, carrier=request.headers.get)


async def read_then_watch(request: Request, call: Call, max_bytes: int) -> bytes:
    """``read_body``, then the watch for the client going away: the server's own callback where it offers one
    (``ON_GONE``: addnorm-serve's connection), else a watch on ``receive()`` (the next ASGI message can only be
    the disconnect: under a test client, Ray Serve's proxy, another ASGI server)."""
    body = await read_body(request, max_bytes)
    on_gone = request.scope.get("extensions", _NO_EXTENSIONS).get(ON_GONE)
    call.watch = _Watch(request, call.gone) if on_gone is None else on_gone(call.gone.fire)
    return body


_NO_EXTENSIONS: dict = {}


# A request still unanswered this long after its body is read is watched for its client leaving.
WATCH_AFTER_S = 0.05


class _Watch:
    """Watches ``receive()`` for the client going away, from ``WATCH_AFTER_S`` after the body was read: most
    requests are answered sooner and never need the task (a task per request, started, stepped and cancelled,
    was a tenth of a small request's work on the event loop). ``cancel``: the request ended."""

    __slots__ = ("_request", "_gone", "_timer", "_task")

    def __init__(self, request: Request, gone: Disconnect) -> None:
        self._request, self._gone, self._task = request, gone, None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(_watch_receive(self._request, self._gone))

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


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


def error_docs(descriptions: dict[int, str], schema: dict = ERROR_SCHEMA) -> dict[str, dict]:
    """OpenAPI ``responses`` entries for errors, each a JSON body of ``schema`` (the API's error shape)."""
    content = {"application/json": {"schema": schema}}
    return {str(code): {"description": text, "content": content} for code, text in descriptions.items()}


def json_route_doc(
    required: list[str], properties: dict, example: dict, answer: dict, description: str, errors: dict
) -> dict:
    """A JSON route's OpenAPI ``openapi_extra``: its request body (an object with ``properties``, ``required``
    present) and example, its 200 answer's schema and description, and its ``errors`` (``error_docs``)."""
    schema = {"type": "object", "required": required, "properties": properties}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema, "example": example}},
        },
        "responses": {
            "200": {"description": description, "content": {"application/json": {"schema": answer}}},
            **errors,
        },
    }


def parse_json(body: bytes, max_elements: int) -> object:
    """Parse a JSON body, refusing one that holds more numbers than any acceptable tensor before parsing it."""
    if not body:
        raise BadInput("request body is empty; send a JSON object")
    # Refuse oversized arrays before building millions of Python floats: a dense array of N values has N - 1
    # commas, and a mask at most as many again (no shorter body has that many: not counted, 0.2 ms per 250 KB).
    if len(body) > 2 * max_elements and body.count(b",") > 2 * max_elements:
        raise TooLarge(f"request holds more than {max_elements} values (ADDNORM_MAX_ELEMENTS); split it")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        hint = (
            " (NaN and Infinity are not valid JSON numbers)" if b"NaN" in body or b"Infinity" in body else ""
        )
        raise BadInput(f"malformed JSON: {exc}{hint}") from None


def timeout_param(value: object) -> float | None:
    """V2's ``timeout`` parameter (tritonclient's, microseconds) in seconds, over HTTP and gRPC."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadInput(f"parameters.timeout must be a positive integer (microseconds), got {quote(value)}")
    return value / 1e6


def check_batch(x: np.ndarray, mask: np.ndarray | None, d_model: int, max_elements: int) -> None:
    """What every decoded request must be: (B, S, d_model), within the size limit, finite, mask (B, S)."""
    if x.ndim != 3:
        raise BadInput(f"{EMBEDDINGS} must be [batch, seq, d_model], got shape {list(x.shape)}")
    if x.shape[-1] != d_model:
        raise BadInput(f"{EMBEDDINGS} last dimension is {x.shape[-1]} but the model's d_model is {d_model}")
    if x.size == 0:
        raise BadInput(f"{EMBEDDINGS} is empty (shape {list(x.shape)})")
    if x.size > max_elements:
        raise TooLarge(
            f"{EMBEDDINGS} has {x.size} elements, above this server's limit of {max_elements} "
            "(ADDNORM_MAX_ELEMENTS); split the batch"
        )
    if not np.isfinite(x).all():
        raise BadInput(
            f"{EMBEDDINGS} must be finite: found NaN or Infinity, or a value too large for float32"
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise BadInput(
            f"{MASK} shape {list(mask.shape)} does not match {EMBEDDINGS} [batch, seq] {list(x.shape[:2])}"
        )


def json_object(doc: dict, key: str, where: str) -> dict:
    """``doc[key]`` as an object; absent or null is an empty one."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{where}.{key} must be an object, got {quote(value)}")
    return value


def json_positive_int(doc: dict, key: str) -> int | None:
    """An optional JSON integer of at least 1 (absent or null: None; true is not 1)."""
    value = doc.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadInput(f"{key} must be a positive integer, got {quote(value)}")
    return value


def json_bool(params: dict, key: str, where: str, default: bool | None) -> bool | None:
    """A JSON boolean: the string "false" is not false. ``default`` None: an optional one (absent or null: None)."""
    value = params.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, bool):
        raise BadInput(f"{where}.{key} must be true or false, got {quote(value)}")
    return value


def holds_literal(data: list) -> bool:
    """Whether a parsed JSON array (lists in lists) holds true, false or null anywhere: numpy reads true and false
    as 1 and 0, so numeric data is checked before it is converted. One C-speed ``map`` per inner list."""
    stack = [data]
    while stack:
        level = stack.pop()
        types = set(map(type, level))
        if bool in types or _NONE in types:
            return True
        if list in types:
            stack.extend(x for x in level if type(x) is list)
    return False


_NONE = type(None)


class Tensors:
    """A decoded request of embeddings (``embeddings`` (B, S, E), ``mask`` (B, S) true at padding), or of what a
    text step made of its inputs (``text``: token ids or texts, embedded by the model's own layer, in parts): the
    ``Decoded`` half of /v1's and V2's request types."""

    embeddings: np.ndarray
    mask: np.ndarray | None
    text: TextRequest | None

    @property
    def rows(self) -> int:
        return self.text.rows if self.text is not None else self.embeddings.shape[0]

    async def run(self, infer: Infer, timeout: float, timer: RequestTimer) -> tuple[Outputs, Timings]:
        if self.text is not None:
            return await self.text.run(infer, timeout, timer)
        return await infer(self.embeddings, self.mask, timeout, timer)
