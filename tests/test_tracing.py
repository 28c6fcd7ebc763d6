"""Tracing lands once, in the request core: a real server exports a span tree per request over OTLP/HTTP to a
receiver this test runs on loopback, for /v1, V2 over HTTP and V2 over gRPC alike, each a child of the
``traceparent`` it was sent with."""

from __future__ import annotations

import collections
import http.server
import json
import threading
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from bench.server import ServerProcess
from tests.helpers import wait_until

pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http", reason="needs the 'otel' extra (make installs it)"
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

E = 32  # tiny_artifact's d_model
TRACE_ID = {
    "v1": "0af7651916cd43dd8448eb211c80319c",
    "v2": "4bf92f3577b34da6a3ce929d0e0e4736",
    "grpc": "5a0e2f1c6b7d48e9a1b2c3d4e5f60718",
}
PARENT = "b7ad6b7169203331"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: keeps every span POSTed to /v1/traces (protobuf)."""

    def __init__(self) -> None:
        self.spans: list = []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def traced(tiny_artifact) -> Iterator[tuple[ServerProcess, Receiver]]:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: export soon after each request
    }
    with ServerProcess(
        ["-m", "addnorm.service", "--artifact", str(tiny_artifact)], env=env, grpc=True
    ) as server:
        yield server, receiver
    receiver.shutdown()


def _traceparent(protocol: str) -> str:
    return f"00-{TRACE_ID[protocol]}-{PARENT}-01"


def test_every_transport_gets_one_span_tree_under_its_traceparent(traced):
    import tritonclient.grpc as grpcclient

    server, receiver = traced
    x = np.random.default_rng(0).standard_normal((2, 3, E)).astype(np.float32)
    body = json.dumps({"embeddings": x.tolist()}).encode()
    req = urllib.request.Request(
        f"{server.base}/v1/encode",
        body,
        {"Content-Type": "application/json", "traceparent": _traceparent("v1")},
    )
    urllib.request.urlopen(req, timeout=30).read()
    v2 = {
        "inputs": [{"name": "embeddings", "shape": [2, 3, E], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    req = urllib.request.Request(
        f"{server.base}/v2/models/encoder/infer",
        json.dumps(v2).encode(),
        {"Content-Type": "application/json", "traceparent": _traceparent("v2")},
    )
    urllib.request.urlopen(req, timeout=30).read()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    inp = grpcclient.InferInput("embeddings", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer("encoder", [inp], headers={"traceparent": _traceparent("grpc")})
    # a request refused by its codec is traced too, with its status
    bad = urllib.request.Request(
        f"{server.base}/v1/encode", b'{"embeddings": [[1, 2]]}', {"traceparent": _traceparent("v1")}
    )
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(bad, timeout=30)

    wait_until(
        lambda: sum(s.name == "addnorm.infer" for s in receiver.spans) >= 4, 20, "four request spans exported"
    )
    wait_until(lambda: len(receiver.spans) >= 4 * 3 + 1, 20, "their children exported")
    exported = collections.Counter(s.span_id for s in receiver.spans)
    roots = [s for s in receiver.spans if s.name == "addnorm.infer"]
    for protocol in ("v1", "v2", "grpc"):
        mine = [s for s in roots if s.trace_id.hex() == TRACE_ID[protocol]]
        ok = [s for s in mine if _attributes(s)["addnorm.status"] == "OK"]
        assert len(ok) == 1, (protocol, [(_attributes(s)) for s in mine])
        root = ok[0]
        assert root.parent_span_id.hex() == PARENT and root.kind == root.SPAN_KIND_SERVER
        attrs = _attributes(root)
        assert attrs["addnorm.protocol"] == protocol and attrs["addnorm.model"] == "encoder"
        assert attrs["addnorm.rows"] == 2
        children = {s.name: s for s in receiver.spans if s.parent_span_id == root.span_id}
        assert set(children) == {"queue", "inference", "encode"}, protocol
        assert _attributes(children["inference"])["addnorm.batch_rows"] >= 2
        for child in children.values():
            assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
            assert child.trace_id == root.trace_id
        # three spans of their own (none reuses the root's id or another's), each exported once
        ids = [root.span_id, *(c.span_id for c in children.values())]
        assert len(set(ids)) == 4 and all(exported[i] == 1 for i in ids), protocol
    refused = [
        s for s in roots if s.trace_id.hex() == TRACE_ID["v1"] and _attributes(s)["addnorm.status"] != "OK"
    ]
    assert len(refused) == 1 and _attributes(refused[0])["addnorm.status"] == "BadInput"
    assert refused[0].status.code == refused[0].status.STATUS_CODE_ERROR


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = value.string_value if value.HasField("string_value") else value.int_value
    return out


def test_tracing_is_off_without_an_endpoint_and_costs_no_span(monkeypatch):
    from addnorm.service.tracing import OFF, Tracing

    tracing = Tracing()
    tracing.configure({})
    assert not tracing.on and tracing.request("v1", None) is OFF
    tracing.configure({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.on
    tracing.configure(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "json"}
    )
    assert not tracing.on  # an unsupported protocol is refused with a log line, not half-configured
