"""Faults: a model run that fails, SIGTERM with requests in flight. Each request is answered or refused, never lost."""

import signal
import threading

import httpx
import numpy as np
from fastapi.testclient import TestClient

from addnorm.service import create_app
from addnorm.service.settings import Settings
from tests.conftest import start_server
from tests.helpers import queue_depth, wait_until, wait_until_ready


class FailOnce:
    """Wraps an engine's onnxruntime sessions (its spinning one for runs at light load too, where there is one): the next
    run of either raises, later ones run."""

    def __init__(self, engine):
        self.failed = False
        for name in ("session", "light_session"):
            if (session := getattr(engine, name)) is not None:
                setattr(engine, name, self._wrapped(session))

    def _wrapped(self, session):
        outer = self

        class Failing:
            def run(self, names, feed, options=None):
                if not outer.failed:
                    outer.failed = True
                    raise RuntimeError("injected: the accelerator fell over")
                return session.run(names, feed, options)

        return Failing()


def test_an_engine_failure_answers_a_json_500_and_the_next_request_succeeds(tiny_artifact):
    app = create_app(Settings(artifact=tiny_artifact))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until_ready(client)
        engine = app.state.addnorm.known.models.default.engine
        assert engine.light_session is not None  # the default: a run at light load spins on a second session
        FailOnce(engine)
        body = {"embeddings": [[0.5] * 32]}
        r = client.post("/v1/encode", json=body)
        assert r.status_code == 500 and r.json() == {"error": "inference failed: RuntimeError"}
        r = client.post("/v1/encode", json=body)
        assert r.status_code == 200 and len(r.json()["encoded"]) == 1
        assert client.get("/health/ready").status_code == 200


def test_sigterm_drains_requests_in_flight_then_exits_0(tiny_artifact):
    # A batch of up to 20 rows waits two minutes for company: the four 4-row requests (16 rows) sit queued, a state
    # the test waits for, however slowly they arrive (a 3 s wait was a window a busy machine could miss). SIGTERM
    # runs them at once (the batchers drain when shutdown begins): with the wait, they would time out (504 at 30 s).
    srv = start_server(tiny_artifact, "--max-batch-size", "20", "--max-queue-delay-ms", "120000")
    with srv:
        x = np.random.default_rng(0).standard_normal((4, 2048, 32)).astype("<f4")  # a few hundred ms each
        headers = {"content-type": "application/octet-stream", "x-shape": "4,2048,32",
                   "accept": "application/octet-stream"}  # fmt: skip
        results: list = []

        def call() -> None:
            try:
                results.append(httpx.post(f"{srv.base}/v1/encode", content=x.tobytes(), headers=headers,
                                          timeout=120).status_code)  # fmt: skip
            except httpx.HTTPError as exc:
                results.append(type(exc).__name__)

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        # all four in the server, queued: then SIGTERM
        wait_until(lambda: queue_depth(srv.base) == 4, 60, "the four requests queued in the server")
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) == 0
    assert results == [200] * 4, results
