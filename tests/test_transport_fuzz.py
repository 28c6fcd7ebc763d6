"""A fuzz harness for the transport layer (issue 24): below the payloads, where the protocols' own codecs never look.

HTTP/1.1: valid requests of every kind the server answers (/v1 JSON and binary, V2 JSON and binary, health,
metadata, chunked bodies, pipelined pairs, upgrade requests) mutated at the request line, the headers, the framing
and the bytes, each sent on a raw socket of its own. gRPC: valid serialized messages of every method,
mutated, sent through a channel with identity serializers. Every answer must be a 4xx or 2xx (HTTP: with a JSON
body; gRPC: no INTERNAL or UNKNOWN), the server must stay up, and a valid request right after each case must get
the right answer. Deterministic by default (ADDNORM_FUZZ_SEED picks another run, ADDNORM_FUZZ_CASES scales it);
a failure names the seed, the case and its bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from addnorm.service.protocols.v2 import inference_pb2 as pb
from addnorm.service.protocols.v2.grpc_codec import varint
from tests.conftest import start_server
from tests.helpers import front_proxy

SEED = int(os.environ.get("ADDNORM_FUZZ_SEED", "24"))
CASES = int(os.environ.get("ADDNORM_FUZZ_CASES", "1200"))
E = 32
KEY = "fuzz-key"
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


class _Front:
    """HTTP through the front proxy (nginx, as deploy/nginx runs it: service/front/nginx_conf.py), gRPC on the server's
    own port, and the server's process."""

    def __init__(self, port: int, srv) -> None:
        self.port, self.grpc_port, self.proc = port, srv.grpc_port, srv.proc


@pytest.fixture(scope="module")
def fuzz_server(tiny_artifact):
    limits = dict(header_timeout_s=1, body_timeout_s=1, max_body_bytes=100000)
    flags = [
        "--header-timeout-s",
        "1",
        "--body-timeout-s",
        "1",
        "--api-key",
        KEY,
        "--max-body-bytes",
        "100000",
    ]
    with start_server(tiny_artifact, *flags, grpc=True) as srv, front_proxy(srv.port, **limits) as port:
        yield _Front(port, srv)


# --- HTTP/1.1 ----------------------------------------------------------------------------------------------------


def _request(method: bytes, path: bytes, headers: list[bytes], body: bytes = b"") -> bytes:
    head = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", *headers]
    if body and not any(h.lower().startswith((b"content-length", b"transfer-encoding")) for h in headers):
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _chunked(body: bytes, size: int = 50) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


X = np.linspace(-1, 1, 2 * E, dtype=np.float32).reshape(1, 2, E)
V1_JSON = json.dumps({"embeddings": X[0].tolist()}).encode()
V2_JSON = json.dumps(
    {"inputs": [{"name": "embeddings", "shape": [1, 2, E], "datatype": "FP32", "data": X.ravel().tolist()}]}
).encode()
V2_HEADER = json.dumps(
    {
        "inputs": [
            {
                "name": "embeddings",
                "shape": [1, 2, E],
                "datatype": "FP32",
                "parameters": {"binary_data_size": X.nbytes},
            }
        ]
    }
).encode()
AUTHED = [AUTH.rstrip()]
SEEDS = [
    _request(b"POST", b"/v1/encode", [*AUTHED, b"Content-Type: application/json"], V1_JSON),
    _request(
        b"POST",
        b"/v1/encode",
        [*AUTHED, b"Content-Type: application/octet-stream", b"X-Shape: 1,2,32"],
        X.tobytes(),
    ),
    _request(b"POST", b"/v2/models/encoder/infer", AUTHED, V2_JSON),
    _request(
        b"POST",
        b"/v2/models/encoder/infer",
        [*AUTHED, b"Inference-Header-Content-Length: %d" % len(V2_HEADER)],
        V2_HEADER + X.tobytes(),
    ),
    _request(b"POST", b"/v1/encode", [*AUTHED, b"Transfer-Encoding: chunked"], _chunked(V1_JSON)),
    _request(b"GET", b"/health/ready", []),
    _request(b"GET", b"/v2/models/encoder", AUTHED),
    _request(b"GET", b"/v2", [*AUTHED, b"Connection: Upgrade", b"Upgrade: websocket"]),
    _request(b"POST", b"/v1/encode?model=encoder", [*AUTHED, b"Expect: 100-continue"], V1_JSON),
]
TOKENS = [
    b"GET",
    b"POST",
    b"PUT",
    b"PRI",
    b"CONNECT",
    b"OPTIONS",
    b"TRACE",
    b"\x00",
    b"*",
    b"/",
    b"//",
    b"/..%2f",
    b"%",
    b"%0d%0a",
    b"HTTP/1.0",
    b"HTTP/2.0",
    b"HTTP/9.9",
    b"http://x/v1/encode",
    b"x" * 9000,
    b"\r\n",
    b"\n",
    b" ",
    b"\t",
    b":",
    b";",
    b",",
    b"\xff\xfe",
    b"-1",
    b"0",
    b"18446744073709551616",
    b"chunked",
    b"gzip",
    b"identity",
    b"Upgrade",
    b"h2c",
    b"websocket",
    b"close",
    b"keep-alive",
    b"100-continue",
]
HEADERS = [
    b"Content-Length: 0",
    b"Content-Length: 5",
    b"Content-Length: -1",
    b"Content-Length: 99999999999",
    b"Content-Length: 1, 2",
    b"Content-Length: x",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: chunked, chunked",
    b"Transfer-Encoding: identity",
    b"Content-Encoding: gzip",
    b"Content-Encoding: br",
    b"Content-Type: application/x-npy",
    b"Content-Type: \x01",
    b"Connection: close",
    b"Connection: Upgrade",
    b"Upgrade: h2c",
    b"Expect: 100-continue",
    b"Expect: nonsense",
    b"X-Shape: 1,1,1",
    b"X-Lengths: 1",
    b"Authorization: Bearer nope",
    b"Authorization: " + b"A" * 5000,
    b" folded: line",
    b"NoColon",
    b"X-Request-Id: \x1b[31m",
    b"Inference-Header-Content-Length: 3",
    b"Host: a",
    b"Host:",
    b"Accept: application/x-npy",
    b"Accept: */*;q=x",
]


def _mutate(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One mutation of a request's bytes, and the class it belongs to."""
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    kind = rng.choice(
        ["request-line", "header", "header", "framing", "bytes", "bytes", "pipeline", "truncate"]
    )
    if kind == "request-line":
        parts = lines[0].split(b" ")
        parts[rng.randrange(len(parts))] = rng.choice(TOKENS)
        if rng.random() < 0.2:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(TOKENS))
        lines[0] = b" ".join(parts)
    elif kind == "header":
        op = rng.randrange(4)
        i = rng.randrange(1, len(lines) + 1)
        if op == 0:
            lines.insert(i, rng.choice(HEADERS))
        elif op == 1 and len(lines) > 1:
            del lines[rng.randrange(1, len(lines))]
        elif op == 2 and len(lines) > 1:
            lines.insert(i, lines[rng.randrange(1, len(lines))])  # a header twice
        else:
            name = rng.choice(
                [b"X-A", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Content-Type"]
            )
            lines.insert(i, name + b": " + rng.choice(TOKENS) + rng.choice(TOKENS))
    elif kind == "framing":
        if b"Transfer-Encoding: chunked" in data and rng.random() < 0.7:
            body = body.replace(
                rng.choice([b"0\r\n\r\n", b"\r\n", b"32\r\n"]),
                rng.choice([b"", b"zz\r\n", b"1;ext=1\r\n", b"0\r\nTrailer: x\r\n\r\n"]),
                1,
            )
        else:
            body = (
                body[: rng.randrange(len(body) + 1)]
                if rng.random() < 0.5
                else body + rng.choice(TOKENS) * rng.randrange(1, 4)
            )
    elif kind == "bytes":
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            at = rng.randrange(len(raw))
            op = rng.randrange(3)
            if op == 0:
                raw[at] = rng.randrange(256)
            elif op == 1:
                raw[at:at] = rng.choice(TOKENS)
            else:
                del raw[at : at + rng.randrange(1, 16)]
        return kind, bytes(raw)
    elif kind == "pipeline":  # an unmutated seed first half the time: its own answers must come first
        other = _mutate(rng, rng.choice(SEEDS))[1]
        first, second = (data, other) if rng.random() < 0.5 else (other, data)
        return ("pipeline", first + second) if first is data else ("pipeline-after", first + second)
    else:
        return kind, data[: rng.randrange(len(data))]
    return kind, b"\r\n".join(lines) + sep + body


# Sent after each case: when the case leaves the connection readable, this is answered and the server closes it;
# otherwise the server closed it already, or closes it at its header or body deadline.
LAST = b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` and LAST, read until the server closes (bounded by ``timeout``). (A half-close would read as
    a client gone, whose queued requests the server drops: tests/test_connections.py.)"""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):  # the server may answer and close before everything is sent
            s.sendall(data + LAST)
        chunks, deadline = [], time.monotonic() + timeout
        # the server's header and body deadlines (1 s each) close every connection long before this
        while True:
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(
                    f"the server neither answered LAST nor closed the connection within {timeout} s"
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def _responses(raw: bytes) -> list[tuple[int, bytes]]:
    """Every complete response in ``raw`` (Content-Length or chunked bodies; 1xx have none)."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"a response cut inside its head: {raw[:200]!r}"
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in lines[1:])}
        if status < 200:
            out.append((status, b""))
            raw = rest
            continue
        if fields.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    rest = rest.partition(b"\r\n")[2]
                    break
                body, rest = body + rest[:size], rest[size + 2 :]
        else:
            n = int(fields[b"content-length"])
            body, rest = rest[:n], rest[n:]
        out.append((status, body))
        raw = rest
    return out


def _valid(port: int) -> bytes:
    """The answer to the first seed, a valid /v1 request (then LAST's). Sent in one write, it misses the proxy's
    1 s header deadline only when the machine stalls the client that long between connecting and sending: a
    connection closed unanswered is tried again, once. (Seen once in a CI run on 2 shared cores.) A wrong answer,
    any other status, or a second silent close still fails."""
    got = _responses(_exchange(port, SEEDS[0]))
    if not got:
        got = _responses(_exchange(port, SEEDS[0]))
    assert [s for s, _ in got] == [200, 200], got
    return got[0][1]


def _http_case(
    port: int, case: int, kind: str, data: bytes, expected: bytes, leads: dict[bytes, list[int]]
) -> list[tuple[int, bytes]]:
    where = f"seed {SEED}, case {case} ({kind}): {data[:300]!r}"
    raw = _exchange(port, data)
    if b" HTTP/" not in data.split(b"\r\n", 1)[0] and raw.startswith(b"{"):
        # a request line without a version is HTTP/0.9, which nginx answers as HTTP/0.9: the body alone
        assert "error" in json.loads(raw), f"{where}: {raw[:300]!r}"
        assert _valid(port) == expected, f"{where}: the valid request after it got another answer"
        return []
    try:
        got = _responses(raw)
    except (AssertionError, ValueError, KeyError, IndexError) as exc:
        raise AssertionError(f"{where}: unreadable answer: {exc}") from None
    if kind == "pipeline":  # a valid request pipelined before anything gets its own answers, first
        lead = next(statuses for seed, statuses in leads.items() if data.startswith(seed))
        assert [status for status, _ in got[: len(lead)]] == lead, f"{where}: {got[:3]}"
    for status, body in got:
        assert status < 500, f"{where}: {status} {body[:300]!r}"
        if status >= 400:
            assert "error" in json.loads(body), f"{where}: {body[:300]!r}"
    assert _valid(port) == expected, f"{where}: the valid request after it got another answer"
    return got


def test_http_mutations_never_get_a_5xx_and_the_next_request_is_answered_right(fuzz_server):
    """The cases are drawn in order from the seed and sent by 8 clients at once (many wait for a deadline)."""
    rng = random.Random(SEED)
    port = fuzz_server.port
    expected = _valid(port)
    leads = {seed: [status for status, _ in _responses(_exchange(port, seed))][:-1] for seed in SEEDS}
    cases = [_mutate(rng, rng.choice(SEEDS)) for _ in range(CASES)]
    classes, statuses = Counter(kind for kind, _ in cases), Counter()
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(_http_case, port, i, kind, data, expected, leads)
            for i, (kind, data) in enumerate(cases)
        ]
        for future in futures:
            statuses.update(status for status, _ in future.result())
            assert fuzz_server.proc.poll() is None, "the server exited"
    print(
        f"\nHTTP fuzz: {CASES} cases in {time.monotonic() - start:.1f} s, seed {SEED}; classes {dict(classes)}; "
        f"statuses {dict(sorted(statuses.items()))}"
    )
    assert len(classes) == 7 and statuses[200] and statuses[400]  # every class ran; both outcomes seen


# --- gRPC --------------------------------------------------------------------------------------------------------


def _grpc_seeds() -> dict[str, bytes]:
    infer = pb.ModelInferRequest(model_name="encoder", id="fuzz")
    t = infer.inputs.add(name="embeddings", datatype="FP32", shape=[1, 2, E])
    infer.raw_input_contents.append(X.tobytes())
    typed = pb.ModelInferRequest(model_name="encoder")
    t = typed.inputs.add(name="embeddings", datatype="FP32", shape=[1, 2, E])
    t.contents.fp32_contents.extend(X.ravel().tolist())
    typed.outputs.add(name="encoded")
    return {
        "ModelInfer": infer.SerializeToString(),
        "ModelInfer ": typed.SerializeToString(),  # (the same method, typed contents)
        "ModelMetadata": pb.ModelMetadataRequest(name="encoder", version="1").SerializeToString(),
        "ModelReady": pb.ModelReadyRequest(name="encoder").SerializeToString(),
        "ModelStatistics": pb.ModelStatisticsRequest(name="encoder").SerializeToString(),
        "RepositoryIndex": pb.RepositoryIndexRequest(ready=True).SerializeToString(),
        "ServerMetadata": b"",
    }


def _mutate_message(rng: random.Random, data: bytes) -> tuple[str, bytes | None]:
    raw = bytearray(data)
    kinds = [
        "flip",
        "insert",
        "delete",
        "truncate",
        "append-field",
        "length",
        "groups",
        "long-name",
        "random",
    ]
    kind = rng.choice([*kinds, "no-message"] if rng.random() < 0.05 else kinds)
    if kind == "no-message":  # the client half-closes without sending one
        return kind, None
    if kind == "flip" and raw:
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif kind == "insert":
        at = rng.randrange(len(raw) + 1)
        raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12)))
    elif kind == "delete" and raw:
        at = rng.randrange(len(raw))
        del raw[at : at + rng.randrange(1, 32)]
    elif kind == "truncate":
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif kind == "append-field":  # a field again (last one wins, repeated ones add), any number and wire type
        tag = (rng.randrange(1, 16) << 3) | rng.choice([0, 1, 2, 5])
        value = rng.choice([b"\x01", b"\xff" * 8, b"\x05hello", b"\x00", b"\x80\x80\x80\x80\x10"])
        raw += bytes([tag]) + value
    elif kind == "length":  # a length prefix that lies
        raw = bytearray(bytes([0x0A]) + rng.choice([b"\xff\xff\xff\xff\x0f", b"\x7f", b"\x00"]) + bytes(raw))
    elif kind == "long-name":  # field 1 (every request's name or model_name) far longer than any name
        name = b"n" * rng.choice([300, 10_000, 60_000])
        raw += b"\x0a" + varint(len(name)) + name
    elif kind == "groups":  # deep start-group nesting
        raw = bytearray(b"\x0b" * rng.choice([10, 100, 1000, 100_000]) + bytes(raw))
    else:
        raw = bytearray(rng.randbytes(rng.randrange(0, 200)))
    return kind, bytes(raw)


def test_grpc_mutations_never_get_internal_or_unknown_and_the_next_call_is_answered_right(fuzz_server):
    rng = random.Random(SEED)
    seeds = _grpc_seeds()
    metadata = [("authorization", f"Bearer {KEY}")]
    classes, codes = Counter(), Counter()
    start = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{fuzz_server.grpc_port}") as channel:

        def call(method: str, data: bytes | None) -> tuple[grpc.StatusCode, bytes]:
            path = f"/inference.GRPCInferenceService/{method.strip()}"
            try:
                if data is None:  # no message at all
                    return grpc.StatusCode.OK, channel.stream_unary(path)(
                        iter(()), metadata=metadata, timeout=10
                    )
                return grpc.StatusCode.OK, channel.unary_unary(path)(data, metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                return exc.code(), (exc.details() or "").encode()

        code, expected = call("ModelInfer", seeds["ModelInfer"])
        assert code == grpc.StatusCode.OK
        for case in range(CASES):
            method = rng.choice(list(seeds))
            kind, data = _mutate_message(rng, seeds[method])
            classes[kind] += 1
            code, answer = call(method, data)
            codes[code.name] += 1
            where = f"seed {SEED}, case {case} ({method.strip()}, {kind}): {(data or b'')[:200]!r}"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # only a message above the receive limit
                assert len(data) > 100_000, f"{where}: {code} {answer[:300]!r}"
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                f"{where}: {code} {answer[:300]!r}"
            )
            assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: never answered"
            assert fuzz_server.proc.poll() is None, f"{where}: the server exited"
            assert call("ModelInfer", seeds["ModelInfer"]) == (grpc.StatusCode.OK, expected), where
    print(
        f"\ngRPC fuzz: {CASES} cases in {time.monotonic() - start:.1f} s, seed {SEED}; classes {dict(classes)}; "
        f"codes {dict(codes)}"
    )
    assert len(classes) == 10 and codes["OK"] and codes["INVALID_ARGUMENT"]


def test_grpc_stream_mutations_are_refused_on_the_stream_and_the_stream_goes_on(fuzz_server):
    """ModelStreamInfer: mutated ModelInferRequests on one stream, each followed by the valid one. A mutation is
    answered on the stream (a refusal naming why, never the internal error) and the stream goes on: the valid
    request after it gets the unary call's answer."""
    import queue

    rng = random.Random(SEED + 1)
    seed = _grpc_seeds()["ModelInfer"]
    metadata = [("authorization", f"Bearer {KEY}")]
    sent: queue.Queue = queue.Queue()
    codes = Counter()
    with grpc.insecure_channel(f"127.0.0.1:{fuzz_server.grpc_port}") as channel:
        expected = pb.ModelInferResponse.FromString(
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                seed, metadata=metadata, timeout=10
            )
        )
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = stream(iter(sent.get, None), metadata=metadata, timeout=300)

        def exchange(data: bytes) -> pb.ModelStreamInferResponse:
            sent.put(data)
            return pb.ModelStreamInferResponse.FromString(next(answers))

        for case in range(CASES // 4):
            kind, data = _mutate_message(rng, seed)
            data = data or b""  # "no message": an empty one (a stream carries messages, not their absence)
            if len(data) > 100_000:  # above the receive limit: it would end the stream (RESOURCE_EXHAUSTED)
                continue
            where = f"seed {SEED + 1}, case {case} ({kind}): {data[:200]!r}"
            got = exchange(data)
            codes["refused" if got.error_message else "answered"] += 1
            assert "internal error" not in got.error_message, f"{where}: {got.error_message}"
            again = exchange(seed)
            assert again.error_message == "" and again.infer_response == expected, where
        sent.put(None)
        assert list(answers) == []  # the stream ends when the client ends its side
    assert fuzz_server.proc.poll() is None
    assert codes["refused"] and codes["answered"], codes
