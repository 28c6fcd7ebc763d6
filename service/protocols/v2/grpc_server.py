"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService``, as tritonclient.grpc calls it.

It runs on the app's own event loop (``start`` is called from the app's lifespan) and reaches the models the HTTP
routes reach: the same ``Registry``, the same batchers, statistics and metrics. The same guard decides every call
(``GuardInterceptor``, before the method): ServerLive and ServerReady are open like the health probes; every other
call needs an API key when keys are set (the ``authorization`` metadata, ``Bearer <key>``) and the models'
manifests read. Domain errors become status codes through ``errors.CODES``; the body-size limit is the receive
limit. ModelStreamInfer (many requests on one call) is grpc_stream.py's. Methods not listed in ``_METHODS`` and not
that one answer UNIMPLEMENTED (after the guard, as an unknown HTTP path would).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from addnorm import __version__ as VERSION
from addnorm.service import logs
from addnorm.service.core import inference
from addnorm.service.core.text import TextLimits
from addnorm.service.errors import BadInput, ClientDeadline, ServiceError, grpc_code
from addnorm.service.guard import Guard
from addnorm.service.models.control import check_parameters
from addnorm.service.models.registry import READY
from addnorm.service.models.state import KnownModels, ServiceState
from addnorm.service.protocols.v2 import codec, grpc_codec, grpc_stream, metadata, model_config
from addnorm.service.protocols.v2 import inference_pb2 as pb

SERVICE = "inference.GRPCInferenceService"
# What the guard reads for this transport (service/protocols/__init__.py gathers them): methods are paths.
PUBLIC_PATHS = (f"/{SERVICE}/ServerLive", f"/{SERVICE}/ServerReady")
MODEL_PREFIXES = (f"/{SERVICE}/",)
# HTTP/2 limits of the gRPC port (gRPC core channel arguments), besides the message size (--max-body-bytes), the
# calls in progress (--max-connections) and the request message's deadline (--body-timeout-s): docs/reliability.md.
HTTP2_LIMITS = {
    "grpc.max_concurrent_streams": 128,  # per connection (unset: 2^31 - 1); more are refused by the protocol
    "grpc.max_connection_idle_ms": 300_000,  # a connection without calls for 5 min gets a GOAWAY
    "grpc.max_connection_age_ms": 3_600_000,  # every connection is asked to reconnect after an hour (balancing)
    "grpc.max_connection_age_grace_ms": 60_000,  # ... and its calls get a minute to finish
    "grpc.keepalive_permit_without_calls": 1,  # clients behind NAT may ping an idle connection,
    "grpc.http2.min_ping_interval_without_data_ms": 10_000,  # ... every 10 s at most:
    "grpc.http2.max_ping_strikes": 2,  # the third ping sooner is a GOAWAY (ENHANCE_YOUR_CALM, too_many_pings)
    "grpc.max_metadata_size": 8
    * 1024,  # request metadata: above 8 KiB some calls, above 16 KiB every call is
    "grpc.absolute_max_metadata_size": 16 * 1024,  # ... refused (RESOURCE_EXHAUSTED)
}
log = logging.getLogger("addnorm.grpc")


class InferenceService:
    """One method per RPC; each gets the decoded request and the call's context, past the guard."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def _known(self) -> KnownModels:
        """The models, which the guard made sure of before the method ran."""
        if (
            self.state.known is None
        ):  # the guard refuses model calls until then; a method it missed fails loudly
            raise RuntimeError(
                "a gRPC method ran before the models' manifests were read: the guard missed it"
            )
        return self.state.known

    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.not_ready_reason() is None)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="addnorm", version=VERSION, extensions=codec.EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        models = self._known().models
        slot = models.slot(request.name)
        metadata.check_version(models, request.name, request.version)
        return pb.ModelReadyResponse(ready=slot.state == READY)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        models = self._known().models
        model = models.get(request.name)
        metadata.check_version(models, request.name, request.version)
        return grpc_codec.from_dict(
            metadata.model_metadata(model.engine.manifest, model.version), pb.ModelMetadataResponse
        )

    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        models = self._known().models
        model = models.get(request.name)
        metadata.check_version(models, request.name, request.version)
        return pb.ModelConfigResponse(config=model_config.as_message(metadata.model_configuration(model)))

    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> bytes:
        known = self._known()
        name = request.model_name
        known.models.get(name)  # 404 or 503 before the version (as over HTTP)
        metadata.check_version(known.models, name, request.model_version)

        # A call its client cancels needs no Disconnect: grpc.aio cancels this task, which drops the queued
        # work as a gone HTTP client's does (tests/service/test_inference.py).
        def carrier(key: str) -> str | None:  # read only when tracing is on
            return next((v for k, v in context.invocation_metadata() or () if k == key), None)

        call = inference.Call("grpc", named=name, deadline_s=context.time_remaining(), carrier=carrier)
        infer_codec = grpc_codec.GrpcInferCodec(
            name, known.settings.max_elements, TextLimits.of(known.settings)
        )
        answer, _ = await inference.run(known, call, infer_codec, request)
        return answer

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context
    ) -> pb.ModelStatisticsResponse:
        models = self._known().models
        doc = metadata.statistics(models, request.name, request.version)
        return grpc_codec.from_dict(doc, pb.ModelStatisticsResponse)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context
    ) -> pb.RepositoryModelLoadResponse:
        check_parameters(list(request.parameters))
        await self.state.control.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context
    ) -> pb.RepositoryModelUnloadResponse:
        check_parameters(list(request.parameters), unload=True)
        await self.state.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context
    ) -> pb.RepositoryIndexResponse:
        models = self._known().models
        return grpc_codec.from_dict(
            {"models": metadata.repository_index(models, request.ready)}, pb.RepositoryIndexResponse
        )


_METHODS = {
    "ServerLive": pb.ServerLiveRequest,
    "ServerReady": pb.ServerReadyRequest,
    "ServerMetadata": pb.ServerMetadataRequest,
    "ModelReady": pb.ModelReadyRequest,
    "ModelMetadata": pb.ModelMetadataRequest,
    "ModelConfig": pb.ModelConfigRequest,
    "ModelInfer": pb.ModelInferRequest,
    "ModelStatistics": pb.ModelStatisticsRequest,
    "RepositoryIndex": pb.RepositoryIndexRequest,
    "RepositoryModelLoad": pb.RepositoryModelLoadRequest,
    "RepositoryModelUnload": pb.RepositoryModelUnloadRequest,
}


def _handler(
    name: str, method: Callable[..., Awaitable], state: ServiceState, request_type: type | None = None
) -> Callable[..., Awaitable]:
    """The RPC with the request context the HTTP side has: the message read and parsed here from its raw bytes
    (so a missing or malformed one is INVALID_ARGUMENT, after the guard, with an access line), domain errors as status codes,
    unexpected ones as INTERNAL (logged, never shown), an access line and the request metrics per call."""
    route = f"/{SERVICE}/{name}"

    async def call(_requests: object, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        code, message = grpc.StatusCode.OK, ""
        try:
            request = await _read(request_type, context, name, state.settings.body_timeout_s)
            return await method(request, context)
        except ServiceError as exc:
            code, message = grpc.StatusCode[grpc_code(exc)], exc.message
        except asyncio.CancelledError:  # the client went away or its deadline passed: grpc answers for us
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            log.exception("unexpected error in %s", name)
            code, message = grpc.StatusCode.INTERNAL, "internal error; the server log has the details"
        finally:
            elapsed = time.perf_counter() - start
            state.metrics.observe_request(route, "GRPC", code.name, elapsed)
            if state.settings.access_log:
                logs.access("GRPC %s %s %.1fms", name, code.name, elapsed * 1e3)
        await context.abort(code, message)

    return call


def _serialize(answer: Message | bytes) -> bytes:
    """A handler's answer on the wire: ModelInfer's is already serialized (grpc_codec.encode_infer)."""
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


async def _read(
    request_type: type | None, context: grpc.aio.ServicerContext, name: str, timeout_s: float
) -> object:
    """The call's one request message, parsed. Every method is registered as stream-unary and reads it here:
    grpc.aio's unary handler never answers a call whose client sends no message (it waits for the client's
    deadline); this one answers INVALID_ARGUMENT at once, and DEADLINE_EXCEEDED to a call whose message has not
    arrived within ``timeout_s`` (--body-timeout-s: a stream opened and never sent holds no call slot for long). A
    second message is ignored, as a unary handler does."""
    if request_type is None:  # a refusal's stand-in method reads nothing
        return None
    try:
        raw = await asyncio.wait_for(context.read(), timeout_s)
    except TimeoutError:
        raise ClientDeadline(
            f"the {name} request message did not arrive within {timeout_s:g} s (ADDNORM_BODY_TIMEOUT_S)"
        ) from None
    if raw is grpc.aio.EOF:
        raise BadInput(f"the {name} call ended without a request message; send one {request_type.__name__}")
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise BadInput(
            f"the {name} request is not a valid {request_type.__name__} message: {str(exc)[:200]}"
        ) from None


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """The app's guard before every call, known method or not; a refused call is answered with its code, an
    access line and the request metric, as an HTTP refusal is."""

    def __init__(self, guard: Guard, state: ServiceState) -> None:
        self.guard = guard
        self.state = state

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        def credentials() -> list[bytes]:
            pairs = details.invocation_metadata or ()
            return [
                v.encode("latin-1") if isinstance(v, str) else v for k, v in pairs if k == "authorization"
            ]

        try:
            self.guard.check(details.method, credentials)
        except ServiceError as exc:
            refusal, name = exc, details.method.rpartition("/")[2]

            async def refuse(request, context):
                raise refusal

            return grpc.stream_unary_rpc_method_handler(_handler(name, refuse, self.state))
        return await continuation(details)


async def listen(state: ServiceState, guard: Guard) -> grpc.aio.Server | None:
    """The app's lifespan hook (service/protocols/__init__.py LISTENERS): the gRPC service on ``--grpc-port``,
    or None when it is 0."""
    return await start(state, guard) if state.settings.grpc_port else None


async def start(state: ServiceState, guard: Guard) -> grpc.aio.Server:
    """Start the gRPC service on ``settings.grpc_port`` on the running event loop, behind the app's ``guard``;
    raises OSError when the port cannot be bound."""
    s = state.settings
    options = [
        ("grpc.max_receive_message_length", s.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        # Several uvicorn workers each start one and share the port; one worker must own it alone.
        ("grpc.so_reuseport", 1 if s.workers > 1 else 0),
        # a connection must finish HTTP/2's preface and settings as an HTTP one must send its headers
        ("grpc.server_handshake_timeout_ms", int(s.header_timeout_s * 1000)),
        *HTTP2_LIMITS.items(),
    ]
    server = grpc.aio.server(
        interceptors=[GuardInterceptor(guard, state)],
        options=options,
        maximum_concurrent_rpcs=s.max_connections,
    )
    service = InferenceService(state)
    handlers = {
        name: grpc.stream_unary_rpc_method_handler(  # raw bytes in, read and parsed in the handler (_read)
            _handler(name, getattr(service, name), state, request_type),
            response_serializer=_serialize,
        )
        for name, request_type in _METHODS.items()
    }
    stream = f"/{SERVICE}/{grpc_stream.NAME}"  # many ModelInfer requests on one call (grpc_stream.py)
    handlers[grpc_stream.NAME] = grpc.stream_stream_rpc_method_handler(
        grpc_stream.handler(service.ModelInfer, state, stream)
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    host = f"[{s.host}]" if ":" in s.host else s.host
    try:
        server.add_insecure_port(f"{host}:{s.grpc_port}")
    except RuntimeError as exc:
        raise OSError(
            f"cannot serve gRPC on {s.host}:{s.grpc_port} ({exc}): is the port in use? Set --grpc-port "
            "(ADDNORM_GRPC_PORT) to another port, or 0 to turn gRPC off"
        ) from None
    await server.start()
    log.info("gRPC (Open Inference Protocol) on %s:%d", s.host, s.grpc_port)
    return server
