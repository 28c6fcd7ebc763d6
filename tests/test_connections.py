"""Connections, on both fronts a deployment has: addnorm-serve alone (its HTTP/1.1 connection, service/front/http11.py,
and the app's front) and behind its front proxy (nginx, configured by service/front/nginx_conf.py as deploy/nginx is).
Every protection holds on both: limits are answered, clients that trickle heads or bodies, idle, or never read
cannot hold the server, pipelined requests are answered before a refusal, and bytes no parser accepts get a JSON 400.
docs/reliability.md says which protection lives where."""

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.conftest import start_server
from tests.helpers import front_proxy, queue_depth, wait_until

STRICT = [
    "--max-connections",
    "4",
    "--body-timeout-s",
    "0.5",
    "--keep-alive-s",
    "1",
    "--header-timeout-s",
    "0.5",
]


@pytest.fixture(scope="module")
def strict_server(tiny_artifact):
    with start_server(tiny_artifact, *STRICT) as srv:
        yield srv


class _Proxied:
    """nginx in front of a server with ``strict_server``'s limits; what the tests below need of a server."""

    def __init__(self, port: int) -> None:
        self.port, self.base = port, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def proxied(tiny_artifact):
    """Its own server (the proxy's idle connections to it count against its cap), behind nginx."""
    limits = dict(max_connections=4, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=1)
    with start_server(tiny_artifact, *STRICT) as srv, front_proxy(srv.port, **limits) as port:
        yield _Proxied(port)


@pytest.fixture(params=["alone", "behind the proxy"])
def front(request):
    """Each test that takes it runs twice: against addnorm-serve alone, and behind nginx."""
    return request.getfixturevalue("strict_server" if request.param == "alone" else "proxied")


# A limit on waits only, never the thing asserted: every deadline these tests exercise is 0.5-1 s, and what shows
# which one closed a connection is what the server answered, not how long it took.
GENEROUS_S = 30


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=GENEROUS_S)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def _still_serves(srv) -> None:
    r = httpx.post(f"{srv.base}/v1/encode", json={"embeddings": [[0.1] * 32]}, timeout=5)
    assert r.status_code == 200, r.text


def test_past_the_connection_limit_a_503(strict_server):
    """addnorm-serve's cap (--max-connections): a request on a connection past it is refused with a JSON 503 naming
    the setting (behind the proxy, the proxy's: below)."""
    held = [_connect(strict_server) for _ in range(4)]
    try:
        time.sleep(0.1)
        extra = _connect(strict_server)
        extra.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        status, doc = _status_and_json(_read_all(extra))
        assert status == 503 and "ADDNORM_MAX_CONNECTIONS" in doc["error"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"{strict_server.base}/health/ready", timeout=5).status_code == 200


def test_behind_the_proxy_past_the_connection_limit_a_json_503(proxied):
    """Requests in progress at once beyond the proxy's share of --max-connections: a JSON 503, and the server
    behind it never sees more connections than its own cap."""
    held = []
    try:
        for _ in range(2):  # a head read, a body still to come: in progress
            s = _connect(proxied)
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            held.append(s)
        time.sleep(0.1)
        extra = _connect(proxied)
        extra.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        status, doc = _status_and_json(_read_all(extra))
        assert status == 503 and "ADDNORM_MAX_CONNECTIONS" in doc["error"]
    finally:
        for s in held:
            s.close()
    wait_until(lambda: httpx.get(f"{proxied.base}/health/ready", timeout=5).status_code == 200, GENEROUS_S)


@pytest.mark.parametrize("when", ["trickled", "nothing"])
def test_a_head_not_sent_in_time_is_closed(front, when):
    """A head trickled a byte at a time: closed at the header deadline (0.5 s), with a JSON 408 from addnorm-serve,
    unanswered by nginx; a connection that never sends a byte: closed silently once idle. The server serves on."""
    s = _connect(front)
    trickled = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    if when == "trickled":
        try:
            for byte in trickled:  # one byte every 50 ms: 12 s in all, were it not cut off
                s.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            pass  # closed, as it should be
    raw = _read_all(s)
    if raw:
        status, doc = _status_and_json(raw)
        assert when == "trickled" and status == 408 and "not received in time" in doc["error"], raw
    _still_serves(front)


def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(strict_server):
    """The app's front (front.middleware.Front): a body not received within --body-timeout-s is a JSON 408, then the
    connection closes (what is left of the body is never read)."""
    s = _connect(strict_server)
    s.sendall(
        b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    status, doc = _status_and_json(_read_all(s))  # _read_all returns: the server closed the connection
    assert status == 408 and "request body not received within 0.5 s" in doc["error"]
    _still_serves(strict_server)


def test_behind_the_proxy_a_body_that_never_arrives_is_cut_off(proxied):
    s = _connect(proxied)
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    raw = _read_all(s)  # the proxy closes it at its body deadline
    assert raw == b"" or _status_and_json(raw)[0] == 408
    _still_serves(proxied)


def test_idle_keep_alive_connections_close(front):
    """Kept alive after an answer (a second request on it is answered), closed once idle, silently."""
    s = _connect(front)
    for _ in range(2):
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'"live"' not in answer:
            answer += s.recv(65536)
        assert b" 200 " in answer
    assert _read_all(s) == b""  # closed by the server once idle for --keep-alive-s, with nothing said


@pytest.mark.parametrize(
    "garbage", [b"\x16\x03\x01 not http at all\r\n\r\n", b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n"]
)
def test_garbage_is_a_json_400_and_the_server_serves_on(front, garbage):
    s = _connect(front)
    s.sendall(garbage)
    status, doc = _status_and_json(_read_all(s))
    assert status == 400 and "malformed HTTP request" in doc["error"]
    _still_serves(front)


def test_a_client_still_sending_a_refused_body_gets_its_413(tiny_artifact):
    """A body above the limit is answered 413 before it is read; a client that writes all of it before reading
    must still get that answer (a connection closed at once with unread data makes the kernel reset it, and the
    413 is lost: the app does not ask for a close, uvicorn reads and drops the rest; the proxy lingers)."""
    body = b"0" * 2_000_000
    head = (
        b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    )
    with (
        start_server(tiny_artifact, "--max-body-bytes", "100000") as srv,
        front_proxy(srv.port, max_body_bytes=100000) as port,
    ):
        for front in (srv, _Proxied(port)):
            for _ in range(10):
                with _connect(front) as sock:
                    sock.sendall(head % len(body) + body)  # everything first, as a simple client does
                    sock.shutdown(socket.SHUT_WR)
                    status, doc = _status_and_json(_read_all(sock))
                    assert status == 413 and "limit" in doc["error"]


def _v2_infer(rows: int) -> bytes:
    body = json.dumps(
        {
            "inputs": [
                {"name": "embeddings", "shape": [rows, 2, 32], "datatype": "FP32", "data": [0.5] * rows * 64}
            ]
        }
    ).encode()
    head = b"POST /v2/models/encoder/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _stats(base: str) -> tuple[int, int]:
    s = httpx.get(f"{base}/v2/models/encoder/stats").json()["model_stats"][0]
    return s["execution_count"], s["inference_stats"]["fail"]["count"]


def _queued(base: str) -> int:
    metrics = httpx.get(f"{base}/metrics").text
    return int(
        float(next(ln.split()[-1] for ln in metrics.splitlines() if ln.startswith("addnorm_queue_depth{")))
    )


def test_a_queued_request_whose_client_hangs_up_is_never_run(tiny_artifact):
    """The connection tells the waiting handler its client is gone: the request leaves the queue unrun (499).
    A full batch (8 rows) runs at once; a smaller one waits for the 5 s queue delay, then the batcher finds it
    gone (the client hangs up within ms of seeing it queued, so 5 s is a margin, not a race)."""
    with start_server(tiny_artifact, "--max-queue-delay-ms", "5000", "--max-batch-size", "8") as srv:
        with _connect(srv) as s:  # two pipelined requests on one keep-alive connection, both answered
            s.sendall(_v2_infer(8) + _v2_infer(8))
            raw = b""
            while raw.count(b'"outputs"') < 2:
                raw += s.recv(65536)
            assert raw.count(b"HTTP/1.1 200") == 2
            assert _stats(srv.base) == (2, 0)  # one after the other: pipelined requests are served in order
            s.sendall(_v2_infer(3))  # a third, on the same connection: it waits in the queue ...
            wait_until(lambda: queue_depth(srv.base) == 1, GENEROUS_S, "the third request queued")
        # ... and its client hung up: it leaves the queue without a run
        wait_until(lambda: _stats(srv.base)[1] == 1, GENEROUS_S, "the hung-up request counted as failed")
        wait_until(lambda: queue_depth(srv.base) == 0, GENEROUS_S, "the batcher past the hung-up request")
        assert _stats(srv.base) == (2, 1)  # and it did not run
        assert 'status="499"' in httpx.get(f"{srv.base}/metrics").text
        full = _v2_infer(8).split(b"\r\n\r\n", 1)[1]  # a full batch: it runs at once
        r = httpx.post(f"{srv.base}/v2/models/encoder/infer", content=full, timeout=GENEROUS_S)
        assert r.status_code == 200 and _stats(srv.base) == (3, 1)


def _responses(raw: bytes) -> list[tuple[int, dict]]:
    """Every response on a connection, in order (each with a Content-Length)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(v) for k, _, v in (h.partition(b":") for h in lines[1:]) if k.lower() == b"content-length"
        )
        out.append((int(lines[0].split(b" ")[1]), json.loads(rest[:length])))
        raw = rest[length:]
    return out


def _encode_request(extra: bytes = b"") -> bytes:
    body = json.dumps({"embeddings": [[0.5] * 32]}).encode()
    return (
        b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
        % (extra, len(body))
        + body
    )


@pytest.mark.parametrize("valid", [1, 3])
def test_pipelined_requests_before_garbage_each_get_their_answer_first(front, valid):
    """HTTP/1.1 pipelining: every complete request before a malformed one is answered, in order, then the 400
    (the 400 alone came back before, read by the client as the answer to its valid request; issue 24)."""
    s = _connect(front)
    s.sendall(_encode_request() * valid + b"NOT HTTP AT ALL\r\n\r\n")
    got = _responses(_read_all(s))
    assert [status for status, _ in got] == [200] * valid + [400], got
    assert all(len(doc["encoded"]) == 1 for _, doc in got[:valid])
    assert "malformed HTTP request" in got[-1][1]["error"]


def test_a_request_whose_body_breaks_behind_a_pipelined_one_is_never_run(front):
    s = _connect(front)
    broken = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n"
    s.sendall(_encode_request() + broken)
    assert [status for status, _ in _responses(_read_all(s))] == [200, 400]


@pytest.mark.parametrize(
    "upgrade",
    [b"websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13", b"h2c"],
)
def test_a_protocol_upgrade_is_never_handed_off(strict_server, proxied, upgrade):
    """Upgrade (websocket, h2c) is answered as plain HTTP/1.1 (uvicorn with --ws none): a GET is served. A request
    with a body: behind the proxy, served as any other (nginx never passes an Upgrade on); addnorm-serve alone stops
    parsing at an upgrade (what follows would be the other protocol's), so the request is answered without its body
    (a 400 naming it) and the connection closes."""
    headers = b"Connection: Upgrade\r\nUpgrade: " + upgrade + b"\r\n"
    for front in (strict_server, proxied):
        with _connect(front) as s:
            s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
            status, doc = _first_response(s)
            assert status == 200 and doc["name"] == "addnorm"
    with _connect(proxied) as s:
        s.sendall(_encode_request(headers))
        status, doc = _first_response(s)
        assert status == 200 and len(doc["encoded"]) == 1
    with _connect(strict_server) as s:
        s.sendall(_encode_request(headers))
        [(status, doc)] = _responses(_read_all(s))
        assert status == 400 and "body is empty" in doc["error"]


def _first_response(s: socket.socket) -> tuple[int, dict]:
    """The first whole response on ``s`` (read until it has come, however many reads that takes)."""
    raw = b""
    while True:
        chunk = s.recv(65536)
        assert chunk, raw
        raw += chunk
        try:
            return _responses(raw)[0]
        except (StopIteration, ValueError, IndexError):
            continue


def test_upgrade_requests_cannot_hold_every_connection(strict_server):
    """As many upgrade requests as --max-connections, never read by their clients: a fresh client is still
    served (each is answered and closed)."""
    held = []
    try:
        for _ in range(4):
            s = _connect(strict_server)
            s.sendall(_encode_request(b"Connection: Upgrade\r\nUpgrade: websocket\r\n"))
            held.append(s)
        deadline = time.monotonic() + 10
        while True:  # the server closes each after its answer; the slots come back
            r = httpx.post(f"{strict_server.base}/v1/encode", json={"embeddings": [[0.5] * 32]}, timeout=5)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
    finally:
        for s in held:
            s.close()


def test_a_transfer_coding_other_than_chunked_is_refused(front):
    """Transfer-Encoding: gzip, chunked is a JSON 400 (nginx's 501, answered as a 4xx: a client's mistake)."""
    s = _connect(front)
    s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
    [(status, doc)] = _responses(_read_all(s))
    assert status == 400 and "Transfer-Encoding" in doc["error"]


def _answered(srv, route: str) -> int:
    """The server's count of answered requests on ``route`` (its /metrics)."""
    text = httpx.get(f"{srv.base}/metrics", timeout=GENEROUS_S).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("addnorm_requests_total{") and f'route="{route}"' in line
        )
    )


@contextlib.contextmanager
def _serving(tiny_artifact, where: str, **limits):
    """addnorm-serve with ``limits`` (settings' names), alone or behind nginx with the same limits: yields (the
    server, the front a client talks to)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in limits.items()]
    with start_server(tiny_artifact, *flags) as srv:
        if where == "alone":
            yield srv, srv
        else:
            with front_proxy(srv.port, **limits) as port:
                yield srv, _Proxied(port)


@pytest.mark.parametrize("where", ["alone", "behind the proxy"])
def test_a_client_that_reads_none_of_its_answers_is_dropped(tiny_artifact, where):
    """A client that pipelines requests and reads no answer: one request is taken at a time, the next only once
    the last answer has drained (addnorm-serve holds one unread answer a connection; nginx holds it for the client,
    in memory then on disk), and a client that reads nothing of it for --send-timeout-s is disconnected. The server
    serves others throughout."""
    body = json.dumps({"embeddings": [[0.5] * 32] * 128}).encode()  # answered with ~5x its size in JSON
    request = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _serving(tiny_artifact, where, send_timeout_s=1) as (srv, front):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing holds little
        s.connect(("127.0.0.1", front.port))
        s.settimeout(2.0)
        sent, deadline = 0, time.monotonic() + GENEROUS_S
        try:
            while sent < 2000 and time.monotonic() < deadline:
                s.sendall(request)  # blocks, then times out (or is closed), once the server stops reading
                sent += 1
        except OSError:
            pass
        assert sent < 2000, f"all {sent} requests of a client that reads nothing were read"
        _still_serves(front)
        wait_until(lambda: _closed(s), GENEROUS_S, "the client that reads nothing dropped")
        answered = _answered(srv, "/v1/encode")
        assert 0 < answered < sent, (answered, sent)
        s.close()


def _closed(s: socket.socket) -> bool:
    """Whether the peer has closed ``s`` (what it sent drained, then end of file or a reset)."""
    try:
        while s.recv(1 << 20):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("where", ["alone", "behind the proxy"])
def test_24_clients_that_never_read_hold_bounded_memory_and_none_after_they_go(tiny_artifact, where):
    """24 clients pipelining requests with large answers (~1.2 MB each) and reading none (issue 74: addnorm-serve
    alone went from 223 MB to 910 MB and kept 716 MB after 65 s). Alone, each connection holds one unread answer
    at most, all of them at most --max-unread-bytes (8 MB here: the connections holding the most are closed past
    it), and each is dropped after --send-timeout-s; behind the proxy, nginx holds them. The server's memory stays
    within its baseline plus the bound while they hold on, is back within 1.5x of its baseline 5 s after they go,
    and it serves throughout."""
    from bench.reliability import proc_rss_mb

    body = json.dumps({"embeddings": [[0.5] * 32] * 512}).encode()  # answered with ~5x its size in JSON
    request = b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    limits = dict(send_timeout_s=2, max_answer_buffer_bytes=1 << 20, max_unread_bytes=8 << 20)
    with _serving(tiny_artifact, where, **limits) as (srv, front):
        _still_serves(srv)
        baseline = proc_rss_mb(srv.proc.pid)
        clients = []
        for _ in range(24):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", front.port))
            s.settimeout(0.5)
            clients.append(s)
        deadline = time.monotonic() + GENEROUS_S
        peak = baseline
        for s in clients:  # each writes until the server stops reading it (or it is dropped)
            with contextlib.suppress(OSError):
                for _ in range(200):
                    s.sendall(request)
            peak = max(peak, proc_rss_mb(srv.proc.pid))
            assert time.monotonic() < deadline + GENEROUS_S
        _still_serves(front)
        # the answers held (8 MB) and the requests being read (24 x ~0.3 MB), with the allocator's slack
        assert peak <= baseline + 200, (baseline, peak)
        for s in clients:
            s.close()
        time.sleep(5)
        rss = proc_rss_mb(srv.proc.pid)
        assert rss <= 1.5 * baseline, (baseline, rss)
        _still_serves(front)
