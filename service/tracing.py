"""OpenTelemetry traces of inference requests, exported over OTLP; off unless the SDK's own variables ask for it.

On when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (and ``OTEL_SDK_DISABLED``
is not true) and the ``otel`` extra is installed. ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` picks ``http/protobuf``
(the default) or ``grpc``; ``OTEL_SERVICE_NAME`` (default ``addnorm``), ``OTEL_RESOURCE_ATTRIBUTES`` and the
``OTEL_BSP_*`` batch settings are read by the SDK as usual.

Each request through the request core (service/core/inference.py, its only caller) gets one server span,
``addnorm.infer``, whose parent is the W3C ``traceparent`` (and ``tracestate``) it arrived with, an HTTP header or
gRPC metadata, with children ``queue`` (waiting for its batch), ``inference`` (the batch's run: its rows) and
``encode``; attributes ``addnorm.model``, ``addnorm.protocol``, ``addnorm.rows`` and ``addnorm.status``. Off, the
core gets ``OFF``, whose methods do nothing: no span, no allocation on the request path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from addnorm.service.batching.merging import Timings
from addnorm.service.errors import ServiceError

log = logging.getLogger("addnorm.tracing")
PROTOCOLS = ("http/protobuf", "grpc")
Carrier = Callable[[str], "str | None"]  # a request's header or metadata value by (lower-case) name


class RequestSpan:
    """What the core records of one request. This base does nothing: it is the tracing-off path."""

    def __enter__(self) -> RequestSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        return None

    def model(self, name: str, rows: int) -> None:
        """The request's model and rows, once decoded."""

    def ran(self, timings: Timings) -> None:
        """Its queue wait and its batch's run, as the batcher timed them (just ended)."""

    def encoding(self) -> contextlib.AbstractContextManager[None]:
        return _NOTHING


_NOTHING = contextlib.nullcontext()  # stateless: one for every request
OFF = RequestSpan()


class _Span(RequestSpan):
    def __init__(self, tracer: Any, protocol: str, carrier: Carrier | None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._tracer = tracer
        headers = {k: v for k in ("traceparent", "tracestate") if carrier and (v := carrier(k))}
        parent = TraceContextTextMapPropagator().extract(headers) if headers else None
        self._span = tracer.start_span(
            "addnorm.infer",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"addnorm.protocol": protocol},
        )
        self._context = trace.set_span_in_context(self._span)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        status = "OK" if exc is None else (type(exc).__name__ if isinstance(exc, ServiceError) else "error")
        self._span.set_attribute("addnorm.status", status)
        if exc is not None:
            self._span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(exc)[:200]))
        self._span.end()

    def model(self, name: str, rows: int) -> None:
        self._span.set_attribute("addnorm.model", name)
        self._span.set_attribute("addnorm.rows", rows)

    def ran(self, timings: Timings) -> None:
        end = time.time_ns()
        ran_from = end - int(timings.infer_s * 1e9)
        queued_from = ran_from - int(timings.queue_s * 1e9)
        for name, start, stop, attributes in (
            ("queue", queued_from, queued_from + int(timings.queue_s * 1e9), {}),
            ("inference", ran_from, end, {"addnorm.batch_rows": timings.batch_rows}),
        ):
            child = self._tracer.start_span(
                name, context=self._context, start_time=start, attributes=attributes
            )
            child.end(end_time=stop)

    @contextlib.contextmanager
    def encoding(self) -> Iterator[None]:
        with self._tracer.start_as_current_span("encode", context=self._context):
            yield


class Tracing:
    """The process's tracer, or none. ``request(protocol, carrier)`` gives the core a span for one request."""

    def __init__(self) -> None:
        self._tracer: Any = None
        self._provider: Any = None

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def request(self, protocol: str, carrier: Carrier | None) -> RequestSpan:
        return OFF if self._tracer is None else _Span(self._tracer, protocol, carrier)

    def configure(self, environ: dict[str, str] | os._Environ = os.environ) -> None:
        """Turn tracing on when the OTLP variables ask for it (see the module's docstring); log the choice."""
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if not endpoint or environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or self.on:
            return
        protocol = (
            environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or PROTOCOLS[0]
        )
        if protocol not in PROTOCOLS:
            log.error(
                "tracing off: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not one of %s", protocol, ", ".join(PROTOCOLS)
            )
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            log.warning(
                "tracing off: OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK or its OTLP exporter is "
                "not installed (%s); install the 'otel' extra: pip install '.[otel]'",
                exc.name,
            )
            return
        resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or "addnorm"})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._tracer = self._provider.get_tracer("addnorm")
        log.info("tracing on: OTLP %s to %s", protocol, endpoint)

    def shutdown(self) -> None:
        """Export what is buffered and stop (the app's lifespan calls it on the way out)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None


TRACING = Tracing()
