"""HTTP/2 on the gRPC port (issue 36): the limits set (service/protocols/v2/grpc_server.py HTTP2_LIMITS) and what
they hold against, spoken frame by frame with the h2 library on raw sockets: rapid reset (CVE-2023-44487: streams
opened and cancelled at once), SETTINGS and PING floods, streams opened and never sent, oversized metadata. While
each runs, a fresh tritonclient is served right answers; afterwards the server's memory comes back."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest

from addnorm.service.backend.engine import Engine
from addnorm.service.protocols.v2.grpc_server import HTTP2_LIMITS, SERVICE
from bench.reliability import proc_rss_mb
from bench.server import ServerProcess
from tests.conftest import start_server

pytestmark = pytest.mark.server

E = 32
INFER = f"/{SERVICE}/ModelInfer"
HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", INFER),
    (":authority", "127.0.0.1"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


@pytest.fixture(scope="module")
def server(tiny_artifact) -> Iterator[ServerProcess]:
    with start_server(tiny_artifact, "--body-timeout-s", "1", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def want(tiny_artifact) -> np.ndarray:
    return Engine(tiny_artifact, "cpu", intra_op_threads=1).run(_x())["encoded"]


def _x() -> np.ndarray:
    return np.linspace(-1, 1, 3 * E, dtype=np.float32).reshape(1, 3, E)


def _served(port: int, want: np.ndarray) -> None:
    """A fresh tritonclient (its own connection) gets the right answer."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inp = tg.InferInput("embeddings", [1, 3, E], "FP32")
        inp.set_data_from_numpy(_x())
        got = client.infer("encoder", [inp], client_timeout=30).as_numpy("encoded")
        np.testing.assert_allclose(got, want, atol=1e-6)
    finally:
        client.close()


class Raw:
    """One HTTP/2 connection spoken frame by frame; a thread reads whatever the server sends into h2's state."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.lock = threading.Lock()
        self.events: list = []
        self.closed = threading.Event()
        self.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def flush(self) -> bool:
        """Send what h2 has queued; False once the server has closed the connection."""
        with self.lock:
            data = self.conn.data_to_send()
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed.set()
                return
            with self.lock:
                try:
                    self.events += self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    self.closed.set()
                    return
            self.flush()  # h2's own answers (SETTINGS and PING acks, window updates)

    def do(self, step: Callable[[h2.connection.H2Connection], object]) -> object:
        with self.lock:
            return step(self.conn)

    def wait_for(self, condition: Callable[[list], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.events):
            assert time.monotonic() < deadline, self.events[-5:]
            time.sleep(0.01)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _while_flooding(server: ServerProcess, want: np.ndarray, flood: Callable[[], None]) -> None:
    """Run ``flood`` on its own thread while fresh clients are served; then the server's memory comes back within
    1.5x of where it started (waited for, within 60 s) and it still serves."""
    _served(server.grpc_port, want)  # warm: the baseline is a server that has answered
    start = proc_rss_mb(server.proc.pid)
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            flood()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    served = 0
    while not done.is_set() or served == 0:
        _served(server.grpc_port, want)
        served += 1
    assert not errors, errors
    deadline = time.monotonic() + 60
    while (rss := proc_rss_mb(server.proc.pid)) > 1.5 * start:
        assert time.monotonic() < deadline, (start, rss)
        time.sleep(0.2)
    assert server.proc.poll() is None
    _served(server.grpc_port, want)


def test_the_server_announces_its_stream_limit(server):
    raw = Raw(server.grpc_port)
    try:
        raw.wait_for(lambda events: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events))
        assert (
            raw.do(lambda c: c.remote_settings.max_concurrent_streams)
            == HTTP2_LIMITS["grpc.max_concurrent_streams"]
        )
    finally:
        raw.close()


def _flood(port: int, frame: Callable[[h2.connection.H2Connection, int], None], count: int = 20_000) -> None:
    """``count`` frames (``frame(connection, i)`` queues the i-th) on one connection, sent in bursts of 100 as fast as
    the socket takes them, never waiting for an answer; until the server ends the connection (GOAWAY, close)."""
    raw = Raw(port)
    try:
        for first in range(0, count, 100):

            def burst(c: h2.connection.H2Connection, first: int = first) -> None:
                for i in range(first, first + 100):
                    frame(c, i)

            try:
                raw.do(burst)
            except h2.exceptions.ProtocolError:  # the server said GOAWAY: h2 sends no more
                return
            if not raw.flush():
                return
    finally:
        raw.close()


def _reset(c: h2.connection.H2Connection, i: int) -> None:
    sid = c.get_next_available_stream_id()
    c.send_headers(sid, HEADERS)
    c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)


def _settings(c: h2.connection.H2Connection, i: int) -> None:
    c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535 + i % 100})


def _ping(c: h2.connection.H2Connection, i: int) -> None:
    c.ping(i.to_bytes(8, "big"))


@pytest.mark.parametrize("frame", [_reset, _settings, _ping], ids=["rapid-reset", "settings", "ping"])
def test_rapid_reset_and_settings_and_ping_floods(server, want, frame):
    """20,000 streams each opened (a ModelInfer call's HEADERS) and reset at once (CVE-2023-44487), or SETTINGS
    frames (each to be acknowledged), or PINGs, on one connection: others are served meanwhile; the server may
    end the flooding connection."""
    _while_flooding(server, want, lambda: _flood(server.grpc_port, frame))


def test_streams_opened_and_never_sent_end_at_the_body_deadline(server, want):
    """A full connection of calls (the stream limit) whose request message never comes: each is answered
    DEADLINE_EXCEEDED once --body-timeout-s (1 s here) has passed, and a fresh client is served meanwhile."""
    limit = HTTP2_LIMITS["grpc.max_concurrent_streams"]
    raw = Raw(server.grpc_port)
    try:
        raw.wait_for(lambda events: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events))

        def open_all(c: h2.connection.H2Connection) -> list[int]:
            ids = []
            for _ in range(limit):
                ids.append(c.get_next_available_stream_id())
                c.send_headers(ids[-1], HEADERS)
            with pytest.raises(h2.exceptions.TooManyStreamsError):  # the server's limit, as announced
                c.send_headers(c.get_next_available_stream_id(), HEADERS)
            return ids

        ids = raw.do(open_all)
        raw.flush()
        _served(server.grpc_port, want)

        def statuses(events: list) -> dict[int, str]:
            return {
                e.stream_id: dict(e.headers).get(b"grpc-status")
                for e in events
                if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
                and b"grpc-status" in dict(e.headers)
            }

        raw.wait_for(lambda events: set(statuses(events)) >= set(ids))
        assert set(statuses(raw.events).values()) == {b"4"}  # DEADLINE_EXCEEDED
        message = next(
            dict(e.headers).get(b"grpc-message", b"")
            for e in raw.events
            if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
        )
        assert b"did not arrive within" in message, message
    finally:
        raw.close()


def test_metadata_over_the_limit_is_refused(server, want):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    client = tg.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        inp = tg.InferInput("embeddings", [1, 3, E], "FP32")
        inp.set_data_from_numpy(_x())
        big = {"x-padding": "a" * (HTTP2_LIMITS["grpc.absolute_max_metadata_size"] + 1024)}
        with pytest.raises(InferenceServerException) as refused:
            client.infer("encoder", [inp], headers=big, client_timeout=30)
        assert refused.value.status() in ("StatusCode.RESOURCE_EXHAUSTED", "StatusCode.INTERNAL"), (
            refused.value
        )
    finally:
        client.close()
    _served(server.grpc_port, want)
