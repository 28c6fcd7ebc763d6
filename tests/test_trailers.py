"""Trailer fields and long heads on a real server, alone and behind its front proxy (nginx as deploy/nginx runs it,
service/front/nginx_conf.py): a chunked body's trailer section never reaches a decision (RFC 9110 6.5.1: a recipient
must not merge trailer fields into the header section; addnorm-serve's connection (service/front/http11.py) and
nginx both drop it), however the bytes arrive, on /v1 and V2; a head beyond ``MAX_HEAD_BYTES`` is refused and the
server serves on."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from addnorm.service.front.http11 import MAX_HEAD_BYTES
from tests.conftest import start_server
from tests.helpers import front_proxy, raw_http

pytestmark = pytest.mark.server

KEY = "trailer-key"
E = 32
X = np.linspace(-1, 1, 2 * E, dtype=np.float32).reshape(1, 2, E)
BODIES = {
    b"/v1/encode": json.dumps({"embeddings": X[0].tolist()}).encode(),
    b"/v2/models/encoder/infer": json.dumps(
        {
            "inputs": [
                {"name": "embeddings", "shape": [1, 2, E], "datatype": "FP32", "data": X.ravel().tolist()}
            ]
        }
    ).encode(),
}
AUTH = b"Authorization: Bearer " + KEY.encode()


class _Front:
    def __init__(self, port: int, where: str) -> None:
        self.port, self.where = port, where


@pytest.fixture(scope="module", params=["alone", "behind the proxy"])
def server(request, tiny_artifact) -> Iterator[_Front]:
    """addnorm-serve alone, then behind nginx: every test below holds on both."""
    with start_server(tiny_artifact, "--api-key", KEY) as srv:
        if request.param == "alone":
            yield _Front(srv.port, "alone")
        else:
            with front_proxy(srv.port) as port:
                yield _Front(port, "proxy")


def _chunked(path: bytes, head: list[bytes], trailer: list[bytes]) -> bytes:
    body = BODIES[path]
    lines = [b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/json"]
    lines += [*head, b"Transfer-Encoding: chunked", b"Connection: close"]
    chunks = b"%x\r\n%s\r\n" % (len(body), body)
    return (
        b"\r\n".join(lines)
        + b"\r\n\r\n"
        + chunks
        + b"0\r\n"
        + b"".join(t + b"\r\n" for t in trailer)
        + b"\r\n"
    )


# (head fields, trailer fields) -> the status the head alone decides
CASES = {
    "key only in the trailer": ([], [AUTH], 401),
    "a second key in the trailer": ([AUTH], [b"Authorization: Bearer wrong"], 200),
    "the same key again in the trailer": ([AUTH], [AUTH], 200),
    "another content type in the trailer": ([AUTH], [b"Content-Type: application/octet-stream"], 200),
    "an encoding in the trailer": ([AUTH], [b"Content-Encoding: gzip"], 200),
    # a trailer that would frame the message again (RFC 9110 6.5.1: not allowed in a trailer): nginx drops it, and
    # addnorm-serve's parser refuses the request with a 400 naming it (the request is never run)
    "a length in the trailer": ([AUTH], [b"Content-Length: 3"], {"alone": 400, "proxy": 200}),
    "a deadline in the trailer": ([AUTH], [b"Grpc-Timeout: 1n", b"X-Request-Timeout: 0"], 200),
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("case", list(CASES))
def test_a_trailer_never_decides_anything(server, path, case):
    head, trailer, want = CASES[case]
    want = want[server.where] if isinstance(want, dict) else want
    status, body = raw_http(server.port, [_chunked(path, head, trailer)])
    assert status == want, (case, body[:300])
    doc = json.loads(body)
    assert ("encoded" in doc or "outputs" in doc) if want == 200 else ("error" in doc), doc
    if want == 400:
        assert "Content-Length" in doc["error"], doc


def test_however_the_bytes_arrive(server):
    """The trailer-only key, split in two at every byte boundary of the request: 401 each time; and the valid
    request with a wrong second key in its trailer, likewise: 200 each time."""
    for path in BODIES:
        for head, trailer, want in (CASES["key only in the trailer"], CASES["a second key in the trailer"]):
            data = _chunked(path, head, trailer)
            cuts = range(
                1, len(data), 5
            )  # every 5th boundary: the head's, the chunk's and the trailer's all cut
            got = {cut: raw_http(server.port, [data[:cut], data[cut:]])[0] for cut in cuts}
            assert set(got.values()) == {want}, {c: s for c, s in got.items() if s != want}


def test_a_head_or_trailer_section_too_long_is_refused_and_the_server_serves_on(server):
    """A request's head over MAX_HEAD_BYTES (many fields, or one endless field value) is a 431; a trailer section
    of any length is dropped unread (the request is answered); a valid request answers right after each."""
    filler = [b"X-Filler-%d: %s" % (i, b"a" * 1000) for i in range(MAX_HEAD_BYTES // 1000 + 1)]
    endless = [b"X-Endless: " + b"b" * (4 * MAX_HEAD_BYTES)]
    for head, trailer, want in (
        (filler, [], 431),
        (endless, [], 431),
        ([AUTH], filler, 200),
        ([AUTH, *filler[: len(filler) // 2]], filler[: len(filler) // 2], 200),  # each under the limit
    ):
        data = _chunked(b"/v1/encode", head, trailer)
        pieces = [data[i : i + 4096] for i in range(0, len(data), 4096)]  # arriving over many reads
        status, body = raw_http(server.port, pieces)
        assert status == want, body[:300]
        if want != 200:
            assert "head (request line and header fields) is too large" in json.loads(body)["error"]
        assert raw_http(server.port, [_chunked(b"/v1/encode", [AUTH], [])])[0] == 200


def test_pipelined_requests_with_large_bodies_are_not_taken_for_a_long_head(server):
    """Three requests pipelined in one write, each with a 400 kB body: reads that hold one's body and the next one's
    head must not count the body as head bytes."""
    big = json.dumps({"embeddings": np.full((600, E), 0.123456, np.float32).tolist()}).encode()
    assert len(big) > MAX_HEAD_BYTES
    one = b"\r\n".join(
        [b"POST /v1/encode HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/json", AUTH]
        + [b"Content-Length: %d" % len(big)]
    )
    request = one + b"\r\n\r\n" + big
    last = request.replace(b"Host: 127.0.0.1", b"Host: 127.0.0.1\r\nConnection: close", 1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request + request + last)
        raw = b""
        while chunk := s.recv(1 << 20):
            raw += chunk
    assert raw.count(b"HTTP/1.1 200 OK") == 3, raw[:500]
