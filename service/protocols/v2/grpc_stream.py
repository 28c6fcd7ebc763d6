"""ModelStreamInfer: many ModelInferRequests on one gRPC call, each answered on that call when it is done.

Triton's streaming inference (tritonclient.grpc's ``start_stream`` / ``async_stream_infer``, perf_analyzer's
``--streaming``). Each request on the stream is a ModelInfer call in all but the call: the same guard (once, for
the stream), the same ``InferenceService.ModelInfer``, given to ``handler`` (the request core, the batcher, the
model's statistics), an access line and the request metrics per request. What the stream changes:

- the requests of one stream run concurrently, so they batch with each other and with everyone else's, and each
  answer is written as soon as it is done: answers come in the order they finish, each with its request's ``id``;
- a refused request does not end the stream: its answer is a ModelStreamInferResponse whose ``error_message``
  says why (and whose ``infer_response`` carries the refused request's id, as Triton's does); the stream goes on;
- at most ``IN_FLIGHT`` requests of one stream are in progress; the next message is not read until one is done
  (HTTP/2 flow control then holds the client back), so a stream holds no more than a connection's calls would;
- a stream with nothing in progress and no request for ``IDLE_S`` ends (DEADLINE_EXCEEDED), as an idle
  connection does (``grpc.max_connection_idle_ms``); the client ending its side ends the stream once every
  request it sent is answered (OK); the client cancelling it cancels the requests still in progress.

A request's ``triton_enable_empty_final_response`` parameter (``async_stream_infer(enable_empty_final_response=
True)``) gets its answer marked ``triton_final_response``: every answer of a model addnorm serves is its last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from addnorm.service import logs
from addnorm.service.errors import BadInput, ClientDeadline, ServiceError, grpc_code
from addnorm.service.protocols.v2 import inference_pb2 as pb
from addnorm.service.protocols.v2.grpc_codec import varint

if TYPE_CHECKING:
    from addnorm.service.models.state import ServiceState

# one request's ModelInfer (grpc_server.InferenceService.ModelInfer): its answer, a serialized ModelInferResponse
Infer = Callable[[pb.ModelInferRequest, grpc.aio.ServicerContext], Awaitable[bytes]]

NAME = "ModelStreamInfer"
# requests of one stream in progress at once: as many as a connection's calls (grpc.max_concurrent_streams)
IN_FLIGHT = 128
# a stream with nothing in progress and no request for this long ends, as an idle connection does
IDLE_S = 300.0
# ModelStreamInferResponse's field 2, infer_response (a message): its tag, length-delimited wire type
_INFER_RESPONSE_TAG = bytes([2 << 3 | 2])
# Appended to a serialized ModelInferResponse, protobuf merges it in: the answer's parameters gain this one.
_FINAL = pb.ModelInferResponse(
    parameters={"triton_final_response": pb.InferParameter(bool_param=True)}
).SerializeToString()
log = logging.getLogger("addnorm.grpc")


def handler(infer: Infer, state: ServiceState, route: str):
    """The RPC's behaviour (raw messages in and out) for ``grpc.stream_stream_rpc_method_handler``: each request
    on the stream answered by ``infer``."""

    async def call(_requests: object, context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(infer, state, context, route)
        try:
            await stream.serve()
        except ServiceError as exc:  # the stream itself ended (idle): its status says why
            if state.settings.access_log:
                logs.access("GRPC %s stream %s", NAME, grpc_code(exc))
            await context.abort(grpc.StatusCode[grpc_code(exc)], exc.message)
        finally:
            stream.cancel()

    return call


class _Stream:
    """One ModelStreamInfer call: reads requests, runs each in its own task, writes each answer when it is done."""

    def __init__(
        self, infer: Infer, state: ServiceState, context: grpc.aio.ServicerContext, route: str
    ) -> None:
        self.infer, self.state, self.context, self.route = infer, state, context, route
        self.slots = asyncio.Semaphore(IN_FLIGHT)
        self.writing = asyncio.Lock()  # grpc.aio takes one write at a time
        self.tasks: set[asyncio.Task] = set()
        self.last_answer = time.monotonic()

    async def serve(self) -> None:
        """Until the client ends its side (then until every request is answered)."""
        while True:
            await self.slots.acquire()
            raw = await self._next()
            if raw is grpc.aio.EOF:
                break
            task = asyncio.create_task(self._answer(raw))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    async def _next(self) -> object:
        """The next message (or EOF); ends an idle stream (``ClientDeadline``: DEADLINE_EXCEEDED)."""
        read = asyncio.ensure_future(self.context.read())
        while True:
            try:
                done, _ = await asyncio.wait({read}, timeout=IDLE_S)
            except asyncio.CancelledError:  # the call is over: its read with it
                read.cancel()
                raise
            if done:
                return read.result()
            if not self.tasks and time.monotonic() - self.last_answer >= IDLE_S:
                read.cancel()
                raise ClientDeadline(
                    f"no request on this {NAME} stream for {IDLE_S:g} s; the server ended it. Start a new one"
                )

    async def _answer(self, raw: bytes) -> None:
        start = time.perf_counter()
        code, request_id = "OK", ""
        try:
            try:
                request = pb.ModelInferRequest.FromString(raw)
            except DecodeError as exc:
                raise BadInput(
                    f"a {NAME} message is not a valid ModelInferRequest: {str(exc)[:200]}"
                ) from None
            request_id = request.id
            answer = await self.infer(request, self.context)
            if _asks_final(request):
                answer += _FINAL
            message = _INFER_RESPONSE_TAG + varint(len(answer)) + answer  # one copy (50 KB for [1,16,768])
        except ServiceError as exc:
            code = grpc_code(exc)
            message = _refusal(exc.message, request_id)
        except asyncio.CancelledError:  # the stream is over (cancel): nobody to answer
            code = "CANCELLED"
            raise
        except Exception:
            log.exception("unexpected error in %s", NAME)
            code = "INTERNAL"
            message = _refusal("internal error; the server log has the details", request_id)
        finally:
            self.slots.release()
            elapsed = time.perf_counter() - start
            self.state.metrics.observe_request(self.route, "GRPC", code, elapsed)
            if self.state.settings.access_log:
                logs.access("GRPC %s %s %.1fms", NAME, code, elapsed * 1e3)
        async with self.writing:
            try:
                await self.context.write(message)
            except grpc.aio.UsageError:  # the call ended while this request ran: nobody to answer
                return
        self.last_answer = time.monotonic()

    def cancel(self) -> None:
        """The call is over (the client cancelled it, its deadline passed, or it ended): drop what is left."""
        for task in self.tasks:
            task.cancel()


def _asks_final(request: pb.ModelInferRequest) -> bool:
    param = request.parameters.get("triton_enable_empty_final_response")
    return param is not None and param.bool_param


def _refusal(message: str, request_id: str) -> bytes:
    """A refused request's answer on the stream, serialized."""
    return pb.ModelStreamInferResponse(
        error_message=message, infer_response=pb.ModelInferResponse(id=request_id)
    ).SerializeToString()
