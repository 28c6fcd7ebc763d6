"""The request core: what happens to an inference request between its protocol's decode and its encode, the same
for every way in (/v1, V2 over HTTP, V2 over gRPC).

It owns the model lookup (once per request), the deadline, cancellation when the client goes away, and the trace;
the model it looks up does the rest (``ServingModel.request`` and ``infer``: in flight, statistics, batcher, live
parity sampling). A protocol only gives it a codec (``Codec``). Something every request shares (tracing, a rate
limit per client) is one edit here, in ``run``; something every model run shares (live parity sampling, a rate
limit per model), one in ``ServingModel.infer`` (service/models/registry.py): either holds for every transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from addnorm.service.backend.cores import in_worker
from addnorm.service.batching.merging import Outputs, Timings
from addnorm.service.errors import ClientDeadline, ClientGone, ServiceError, TimedOut
from addnorm.service.metrics import RequestTimer
from addnorm.service.models.registry import ServingModel
from addnorm.service.models.state import KnownModels
from addnorm.service.tracing import TRACING, Carrier, RequestSpan

# A codec step's work is counted in bytes of JSON text. Up to OFFLOAD_BYTES it runs on the event loop, where it
# costs less than the hop to a worker thread would; beyond it, in a worker thread, so one big body does not hold up
# every other client. A raw tensor byte (binary data, copied and checked) is far less work than a JSON byte, counted
# as 1/RAW_SHARE; a float32 byte written as JSON, about 1 (bench/studies/codec_cost.py measures each: docs/
# benchmarks.md, "Codec steps leave the event loop by their work").
OFFLOAD_BYTES = 256 * 1024
RAW_SHARE = 16


def work(text: int = 0, raw: int = 0) -> int:
    """A codec step's work for ``offload``: ``text`` bytes of JSON read or float32 bytes written as JSON, ``raw``
    bytes of binary tensor data."""
    return text + raw // RAW_SHARE


# A model's way in for a decoded batch: (x (B, S, E), mask (B, S), timeout s, timer) -> (outputs, timings), as
# ``ServingModel.infer`` is.
Infer = Callable[[np.ndarray, np.ndarray | None, float, RequestTimer], Awaitable[tuple[Outputs, Timings]]]


class Decoded(Protocol):
    """What a codec's decode gives the core (each protocol's request type has these): how many rows it asks for, its
    own deadline, and how it runs on its model. The core knows no more of it: embeddings queue as one batch
    (service/protocols/common.py's ``Tensors``), text in parts (service/core/text.py's ``TextRequest``), each the
    request's own concern."""

    timeout_s: float | None  # the protocol's own timeout parameter (V2's ``timeout``), None if it has none

    @property
    def rows(self) -> int: ...

    async def run(self, infer: Infer, timeout: float, timer: RequestTimer) -> tuple[Outputs, Timings]: ...


P = TypeVar("P")  # a payload as its transport delivers it: an HTTP body's bytes, a gRPC message
R = TypeVar("R", bound=Decoded)
T = TypeVar("T")  # an encoded answer


class Cancellable(Protocol):
    def cancel(self) -> object: ...


# An ASGI scope extension a server may offer (addnorm's own HTTP/1.1 connection does: front/http11.py): a function
# that takes a callback, calls it once the request's client has gone away (at once if it has), and returns what
# cancels that (a ``Cancellable``): no task per request waiting on ``receive()`` for ``http.disconnect``.
ON_GONE = "addnorm.on_gone"


class Disconnect:
    """Whether a request's client has gone away, and who to tell when it does (one callback at a time)."""

    __slots__ = ("gone", "_callback")

    def __init__(self) -> None:
        self.gone = False
        self._callback: Callable[[], object] | None = None

    def notify(self, callback: Callable[[], object] | None) -> None:
        """Call ``callback`` when the client goes away (None: no longer)."""
        self._callback = callback

    def fire(self) -> None:
        self.gone = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


@dataclass
class Call:
    """One request as its transport delivered it.

    ``named``: the model the transport names before the payload is decoded (V2's path, gRPC's ``model_name``): it
    is looked up first (404, 503) and a payload that fails to decode counts against it. None: the payload names
    it (``/v1``'s ``model`` field; the decoded request's ``model``, None for the default).
    ``deadline_s``: the client's own deadline in seconds from now (gRPC's), if the transport has one.
    ``carrier``: the request's header (or gRPC metadata) values by lower-case name, for trace context.
    """

    protocol: str
    named: str | None = None
    started: float = field(default_factory=time.perf_counter)
    gone: Disconnect = field(default_factory=Disconnect)
    deadline_s: float | None = None
    carrier: Carrier | None = None  # its headers or metadata by name (``traceparent``, ``tracestate``)
    watch: Cancellable | None = None  # what watches for the client going away; ``run`` cancels it


Resolve = Callable[[str | None], ServingModel]  # a model name (None: the default) -> the model that serves it


class Codec(Protocol[P, R, T]):
    """A protocol's reading and writing of one request, made by its route from what the transport says of it
    (headers, query, path: the media types, the model named, an output asked for). ``decode`` reads the payload
    against its model's manifest, which it gets from ``resolve`` (by the name the payload or the call gives);
    ``encode`` writes that model's outputs. Either may raise the domain errors (errors.py). ``decode_work`` and
    ``encode_work`` say how much work each is (``work``): above ``OFFLOAD_BYTES`` it leaves the event loop."""

    def decode_work(self, payload: P) -> int: ...

    def encode_work(self, req: R, nbytes: int) -> int: ...  # ``nbytes``: the outputs' float32 bytes

    def decode(self, payload: P, resolve: Resolve) -> R: ...

    def encode(self, req: R, model: ServingModel, outputs: Outputs) -> T: ...


async def run(
    known: KnownModels,
    call: Call,
    codec: Codec[P, R, T],
    payload: P | None = None,
    read: Callable[[], Awaitable[P]] | None = None,
) -> tuple[T, Timings]:
    """Decode ``payload`` with ``codec``, queue on the model's batcher, encode: ``(encoded, timings)``. The model
    the payload is decoded against is the one that serves it (looked up once; a model swapped by model control
    meanwhile serves it to its end). ``read``: the payload is read once the model ``call.named`` is resolved and
    counted in flight (an HTTP body: a request for an unknown or loading model is refused before it is read).

    Raises the domain errors of each step (errors.CODES maps them for every transport).
    """
    try:
        with TRACING.request(call.protocol, call.carrier) as span:
            if call.named is None:  # the payload names it: reading and decoding count as its input stage
                if read is not None:
                    payload = await read()
                req, model = await _decode_unnamed(known, codec, payload)
                with model.request(call.started) as timer:
                    return await _serve(known, call, model, req, timer, span, codec)
            # The model is counted in flight from the moment it is looked up (no await between the two), so
            # the registry stops a replaced or unloaded one only after its last request (service/models/registry.py).
            model = known.models.get(call.named)
            with model.request(call.started) as timer:  # a failed read or decode counts
                if read is not None:
                    payload = await read()
                req = await offload(codec.decode_work(payload), codec.decode, payload, lambda _name: model)
                return await _serve(known, call, model, req, timer, span, codec)
    finally:
        if call.watch is not None:
            call.watch.cancel()


class _FirstLookup:
    """A ``Resolve`` that looks its model up once and keeps it (``model``; None until asked)."""

    def __init__(self, known: KnownModels) -> None:
        self.known, self.model = known, None

    def __call__(self, name: str | None) -> ServingModel:
        if self.model is None:
            self.model = self.known.models.get(name)
        return self.model


async def _decode_unnamed(known: KnownModels, codec: Codec[P, R, T], payload: P) -> tuple[R, ServingModel]:
    """A payload that names its own model: decoded against the model its name resolves to, and that model, the
    one serving now (decoded again in the rare case model control swapped it during the decode)."""
    while True:
        lookup = _FirstLookup(known)
        req = await offload(codec.decode_work(payload), codec.decode, payload, lookup)
        model = known.models.get(getattr(req, "model", None))
        if lookup.model is None or lookup.model is model:
            return req, model


async def _serve(
    known: KnownModels,
    call: Call,
    model: ServingModel,
    req: R,
    timer: RequestTimer,
    span: RequestSpan,
    codec: Codec[P, R, T],
) -> tuple[T, Timings]:
    """A decoded request, on its model: queue (deadline, cancellation), then encode."""
    timer.decoded()
    span.model(model.name, req.rows)
    outputs, timings = await _queue(known, call, model, req, timer)
    span.ran(timings)
    nbytes = sum(out.nbytes for out in outputs.values())
    with span.encoding():
        return await offload(codec.encode_work(req, nbytes), codec.encode, req, model, outputs), timings


def deadline(known: KnownModels, call: Call, req: Decoded) -> float:
    """The one rule: the sooner of the client's deadline, the protocol's timeout parameter and
    ADDNORM_REQUEST_TIMEOUT_S (a client can only shorten the server's own)."""
    limits = (known.settings.request_timeout_s, req.timeout_s, call.deadline_s)
    return min(limit for limit in limits if limit is not None)


async def _queue(
    known: KnownModels, call: Call, model: ServingModel, req: Decoded, timer: RequestTimer
) -> tuple[Outputs, Timings]:
    """The model's run (``ServingModel.infer``: its batcher and statistics), within the request's deadline; the
    client going away cancels the wait (and so the queued work)."""
    handler = asyncio.current_task()
    if handler is None:  # not reachable from a request; keeps the type checker honest
        raise RuntimeError("run() must be awaited inside a request's task")
    if call.gone.gone:
        raise ClientGone
    call.gone.notify(handler.cancel)
    limit = deadline(known, call, req)
    try:
        outputs, timings = await req.run(model.infer, limit, timer)
    except TimedOut:
        if limit >= known.settings.request_timeout_s:
            raise
        raise ClientDeadline(
            f"not answered within the request's own deadline of {limit:g} s (its timeout parameter or the call's "
            f"deadline; the server's own is {known.settings.request_timeout_s:g} s)"
        ) from None
    except asyncio.CancelledError:
        if call.gone.gone:  # cancelled because the client went away, not by a shutdown
            raise ClientGone from None
        raise
    finally:
        call.gone.notify(None)
    return outputs, timings


async def offload(amount: int, fn: Callable[..., T], *args: object) -> T:
    """Run a CPU-bound codec step of ``amount`` work (``work``) in a worker thread when it is big enough to stall
    the event loop."""
    if amount <= OFFLOAD_BYTES:
        return fn(*args)
    try:
        return await in_worker(fn, *args)
    except ServiceError as exc:
        # A refusal raised in the worker holds, through its traceback, the thread's frames (the decoded document:
        # 100,000 parsed entries, say), and the thread pool's future holds the refusal: a cycle that only a full
        # garbage collection frees (measured: +30 MB kept per refused 3 MB V2 body). A refusal needs no traceback.
        raise exc.with_traceback(None) from None
