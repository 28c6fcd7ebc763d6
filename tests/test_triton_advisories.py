"""Regression tests for the classes of input that broke NVIDIA Triton in 2024-2026 (issue 36), written from their
public fixes and tried on every transport that can carry them: chunk bombs (triton-inference-server/server#8305,
#8770: chunked bodies that made the HTTP front allocate without bound), deeply nested JSON, shapes whose element
count or byte size overflows, floods of requested outputs, and model-control names and parameters. Each case is
bounded in time (the server's deadlines) and memory: after each class the server still answers right, and its RSS
comes back within 1.5x of where it started."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from addnorm.service.backend.engine import Engine
from bench.reliability import proc_rss_mb
from bench.server import ServerProcess
from tests.helpers import raw_http

pytestmark = pytest.mark.server

E = 32
X = np.linspace(-1, 1, 2 * E, dtype=np.float32).reshape(1, 2, E)
V1 = json.dumps({"embeddings": X[0].tolist()}).encode()
MAX_BODY = 4_000_000


@pytest.fixture(scope="module")
def server(model_repository: Path) -> Iterator[ServerProcess]:
    args = [
        "-m",
        "addnorm.service",
        "--model-repository",
        str(model_repository),
        "--model-control-mode",
        "explicit",
    ]
    flags = ["--max-body-bytes", str(MAX_BODY), "--body-timeout-s", "3", "--header-timeout-s", "3"]
    with ServerProcess([*args, *flags], grpc=True) as srv:
        for name in (b"encoder", b"encoder-int8"):  # explicit mode starts with none loaded
            assert _post(srv.port, b"/v2/repository/models/" + name + b"/load", b"")[0] == 200
        yield srv


@pytest.fixture(scope="module")
def want(model_repository: Path) -> np.ndarray:
    return Engine(model_repository / "a-fp32", "cpu", 1).run(X)["encoded"]


@pytest.fixture(scope="module")
def stub(server):
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _head(path: bytes, *fields: bytes) -> bytes:
    lines = [b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close", *fields]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _post(
    port: int, path: bytes, body: bytes, content_type: bytes = b"application/json"
) -> tuple[int, bytes]:
    return raw_http(
        port, [_head(path, b"Content-Type: " + content_type, b"Content-Length: %d" % len(body)) + body]
    )


def _chunked(port: int, path: bytes, chunks: list[bytes]) -> tuple[int, bytes]:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = _head(path, b"Content-Type: application/json", b"Transfer-Encoding: chunked")
    return raw_http(port, [head, *(framed[i : i + (1 << 16)] for i in range(0, len(framed), 1 << 16))])


def _still_serving(server: ServerProcess, want: np.ndarray, start_mb: float) -> None:
    status, body = _post(server.port, b"/v1/encode", V1)
    assert status == 200, body[:300]
    np.testing.assert_allclose(np.asarray(json.loads(body)["encoded"], np.float32), want[0], atol=1e-6)
    deadline = time.monotonic() + 60
    while (rss := proc_rss_mb(server.proc.pid)) > 1.5 * start_mb:
        assert time.monotonic() < deadline, (start_mb, rss)
        time.sleep(0.2)


@pytest.fixture
def bounded(server, want) -> Iterator[None]:
    """The test's class of input, then: the server answers right and its memory comes back."""
    _post(server.port, b"/v1/encode", V1)  # warm
    start = proc_rss_mb(server.proc.pid)
    yield
    assert server.proc.poll() is None, server.output()[-3000:]
    _still_serving(server, want, start)


def _error(status: int, body: bytes, statuses: tuple[int, ...]) -> str:
    assert status in statuses, (status, body[:300])
    return json.loads(body)["error"]


def test_chunk_bombs(server, bounded):
    """A valid body in 100,000 one-byte chunks is answered; 5 MB in 100-byte chunks (1 MB over the limit) is
    refused 413 without being held; a 1 MB chunk extension is skipped, never held; a chunk declaring 2^64 - 1 bytes
    or 1 GiB that never comes is held by nothing and ends at the body deadline with a 408."""
    padded = b" " * 100_000 + V1  # leading whitespace: still the same JSON
    status, body = _chunked(server.port, b"/v1/encode", [padded[i : i + 1] for i in range(len(padded))])
    assert status == 200, body[:300]
    over = b" " * (MAX_BODY + 1_000_000)
    status, body = _chunked(server.port, b"/v1/encode", [over[i : i + 100] for i in range(0, len(over), 100)])
    assert "body" in _error(status, body, (413,))
    head = _head(
        b"/v2/models/encoder/infer", b"Content-Type: application/json", b"Transfer-Encoding: chunked"
    )
    status, body = raw_http(server.port, [head + b"1;" + b"a" * 1_000_000 + b"\r\nx\r\n0\r\n\r\n"])
    assert "malformed JSON" in _error(status, body, (400,))  # the extension skipped, never held
    for size in (b"ffffffffffffffff", b"40000000"):  # 2^64 - 1 and 1 GiB declared, 10 bytes sent
        answer = _unanswered(server.port, head + size + b"\r\n" + V1[:10])
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request body not received within 3 s" in answer


def _unanswered(port: int, data: bytes) -> bytes:
    """What the server sends before it closes a connection whose body never completes: a 408 at the body
    deadline (3 s here; the socket's 60 s timeout fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
        return got


def test_deeply_nested_json(server, bounded):
    for path, doc in (
        (b"/v1/encode", b"[" * 100_000 + b"]" * 100_000),
        (b"/v1/encode", b'{"embeddings": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        (b"/v2/models/encoder/infer", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        (b"/v2/models/encoder/infer", b'{"parameters": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001),
    ):
        status, body = _post(server.port, path, doc)
        _error(status, body, (400,))


OVERFLOWING = (
    [2**62, 2**62, E],
    [2**63 - 1, 1, E],
    [1, 2**32, 2**32],
    [2**64, 1, E],
    [-1, 2, E],
    [1, 2, 2**62],
)


def test_shape_element_and_byte_size_overflows_over_v2_http(server, bounded):
    for shape in OVERFLOWING:
        doc = {"inputs": [{"name": "embeddings", "shape": shape, "datatype": "FP32", "data": [0.0] * 4}]}
        status, body = _post(server.port, b"/v2/models/encoder/infer", json.dumps(doc).encode())
        _error(status, body, (400, 413))  # a shape, or one too large to take
    for size in (2**64, 2**63, -8, 2**31):  # binary_data_size past the body, or negative
        header = {
            "inputs": [
                {
                    "name": "embeddings",
                    "shape": [1, 2, E],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
        h = json.dumps(header).encode()
        head = _head(
            b"/v2/models/encoder/infer",
            b"Content-Type: application/octet-stream",
            b"Inference-Header-Content-Length: %d" % len(h),
            b"Content-Length: %d" % (len(h) + X.nbytes),
        )
        status, body = raw_http(server.port, [head + h + X.tobytes()])
        _error(status, body, (400,))


def test_shape_element_and_byte_size_overflows_over_grpc(stub, bounded):
    from tritonclient.grpc import service_pb2 as pb

    for shape in [s for s in OVERFLOWING if all(0 <= d < 2**63 for d in s)]:
        request = pb.ModelInferRequest(model_name="encoder")
        tensor = request.inputs.add(name="embeddings", datatype="FP32")
        tensor.shape.extend(shape)
        request.raw_input_contents.append(X.tobytes())
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=30)
        assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_floods_of_requested_outputs(server, stub, bounded):
    """100,000 requested outputs (the same one again and again, or names the model has not): refused at once on
    V2 HTTP and gRPC, never an answer per entry."""
    from tritonclient.grpc import service_pb2 as pb

    inputs = [{"name": "embeddings", "shape": [1, 2, E], "datatype": "FP32", "data": X.ravel().tolist()}]
    for outputs in ([{"name": "encoded"}] * 100_000, [{"name": f"o{i}"} for i in range(100_000)]):
        doc = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
        assert len(doc) < MAX_BODY
        status, body = _post(server.port, b"/v2/models/encoder/infer", doc)
        _error(status, body, (400,))
    for names in (["encoded"] * 100_000, [f"o{i}" for i in range(100_000)]):
        request = pb.ModelInferRequest(model_name="encoder")
        tensor = request.inputs.add(name="embeddings", datatype="FP32")
        tensor.shape.extend([1, 2, E])
        request.raw_input_contents.append(X.tobytes())
        for name in names:
            request.outputs.add(name=name)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value


NAMES = ["..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "a%00b", "a" * 10_000, "%E5%90%8D", "."]


def test_model_control_names_and_parameters(server, stub, bounded):
    """Paths, NUL bytes, 10 kB and non-ASCII names, and Triton's config override and file uploads, over HTTP and
    gRPC: 4xx / NOT_FOUND / INVALID_ARGUMENT; the repository's own models stay as they are."""
    from tritonclient.grpc import service_pb2 as pb

    for name in NAMES:
        for action in (b"load", b"unload"):
            status, body = _post(server.port, b"/v2/repository/models/" + name.encode() + b"/" + action, b"")
            _error(status, body, (400, 404))
    for params in (
        {"config": json.dumps({"backend": "python"})},
        {"file:1/model.onnx": "AAAA"},
        {f"p{i}": i for i in range(10_000)},
    ):
        doc = json.dumps({"parameters": params}).encode()
        status, body = _post(server.port, b"/v2/repository/models/encoder/load", doc)
        error = _error(status, body, (400, 413))  # 10,000 of them: over the control routes' body limit
        assert "not supported" in error or "limit" in error, error
    for name in ("../../etc/passwd", "/etc/passwd", "a\x00b", "a" * 10_000, "名", "."):
        with pytest.raises(grpc.RpcError) as refused:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=30)
        assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), name
    request = pb.RepositoryModelLoadRequest(model_name="encoder")
    request.parameters["config"].string_param = "{}"
    with pytest.raises(grpc.RpcError) as refused:
        stub.RepositoryModelLoad(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    index = json.loads(_post(server.port, b"/v2/repository/index", b"")[1])
    assert {m["name"]: m["state"] for m in index} == {"encoder": "READY", "encoder-int8": "READY"}
