"""Live parity (issue 26): sampled answers recomputed in float64 (numpy, no torch) and judged by the gate's rule,
off the request path. In-process apps at rate 1.0: a healthy model raises nothing; a graph whose LayerNorm gamma
is skewed 5% is caught within 20 requests, and with action unready becomes UNAVAILABLE; a full queue drops and
counts, never blocks."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from addnorm.export import traces
from addnorm.service import create_app
from addnorm.service.models.live_parity import QUEUE, LiveParity
from addnorm.service.settings import Settings
from tests.conftest import TINY, export_to
from tests.helpers import skew_gamma, wait_until, wait_until_ready

E = 32


def _requests(rng: np.random.Generator, n: int = 12, model: str = "encoder"):
    """Ordinary, ill-conditioned (a large offset with a tiny spread, a 1e4 offset) and padded inputs, over /v1
    and /v2."""
    for i in range(n):
        scale, offset = [(1.0, 0.0), (1e-3, 50.0), (10.0, -3.0), (0.01, 1e4)][i % 4]
        x = (offset + scale * rng.standard_normal((2, 5, E))).astype(np.float32)
        if i % 2:
            mask = [[False] * 5, [False] * 3 + [True] * 2]
            yield "/v1/encode", {"embeddings": x.tolist(), "mask": mask, "model": model}
        else:
            doc = {
                "inputs": [
                    {"name": "embeddings", "shape": [2, 5, E], "datatype": "FP32", "data": x.ravel().tolist()}
                ]
            }
            yield f"/v2/models/{model}/infer", doc


def _counts(client, model: str = "encoder") -> dict:
    return client.get(f"/v1/model?model={model}").json()["live_parity"]


def _app(model_dir, **settings):
    return create_app(Settings(artifact=model_dir, live_parity_rate=1.0, live_parity_budget=1.0, **settings))


VARIANTS = ("fused", "fp16", "int8")


@pytest.fixture(scope="module")
def every_variant(tiny_artifact, tmp_path_factory):
    """A repository of the tiny block in every variant: "encoder" (fp32) and "encoder-fused", "-fp16", "-int8",
    and its packed graph, "encoder-packed" (model/packing.py)."""
    import dataclasses

    repo = tmp_path_factory.mktemp("variants")
    shutil.copytree(tiny_artifact, repo / "fp32")
    with traces.reusing():  # fused and int8 rewrite fp32's graph: one trace of it
        for variant in VARIANTS:
            export_to(repo / variant, TINY, name=f"encoder-{variant}", variant=variant)
    export_to(repo / "packed", dataclasses.replace(TINY, packed=True), name="encoder-packed")
    return repo


def test_a_healthy_model_raises_no_failure_over_hundreds_of_requests_in_every_variant(
    every_variant, monkeypatch
):
    """fp32: 240 requests, ordinary, ill-conditioned, padded or not, all checked, none failed; fused, fp16 and
    int8 likewise over 60 each, each judged with its own tolerance and its own arithmetic's allowance (the
    int8 and fp16 schemes computed in numpy, model/schemes.py). The queue is made long enough for every sample:
    on a busy machine the checker falls behind and would drop some (which a later test covers)."""
    from addnorm.service.models import live_parity

    monkeypatch.setattr(live_parity, "QUEUE", 1000)  # as every_sample_kept
    app = create_app(Settings(model_repository=every_variant, live_parity_rate=1.0, live_parity_budget=1.0))
    sent = {"encoder": 240, **{f"encoder-{v}": 60 for v in (*VARIANTS, "packed")}}
    with TestClient(app) as client:
        wait_until_ready(client)
        for model, n in sent.items():
            for path, doc in _requests(np.random.default_rng(3), n, model):
                assert client.post(path, json=doc).status_code == 200
        for model, n in sent.items():  # the checker thread: slow on a busy machine
            wait_until(lambda m=model, n=n: _counts(client, m)["checked"] == n, 300, f"{model}: {n} checked")
            counts = _counts(client, model)
            assert counts["failed"] == 0 and counts["dropped"] == 0 and counts["judged"], (model, counts)
            assert 0 < counts["worst_ratio"] < 1, (model, counts)


@pytest.fixture
def every_sample_kept(monkeypatch):
    """A queue long enough for every sample a test waits on: with QUEUE (8) a busy machine's checker falls
    behind a fast client and the rest are dropped for good, so a wait for all of them checked waits on luck (the
    drops themselves: test_a_full_queue_drops_and_counts_and_never_blocks)."""
    from addnorm.service.models import live_parity

    monkeypatch.setattr(live_parity, "QUEUE", 1000)


def test_a_healthy_model_raises_no_failure_on_any_input(tiny_artifact, every_sample_kept):
    with TestClient(_app(tiny_artifact)) as client:
        wait_until_ready(client)
        sent = 0
        for path, doc in _requests(np.random.default_rng(0)):
            assert client.post(path, json=doc).status_code == 200
            sent += 1
        wait_until(lambda: _counts(client)["checked"] == sent, 300, "every sample checked")
        counts = _counts(client)
        assert counts["failed"] == 0 and counts["dropped"] == 0 and 0 < counts["worst_ratio"] < 1, counts
        metrics = client.get("/metrics").text
        assert f'addnorm_live_parity_checked_total{{model="encoder"}} {float(sent)}' in metrics
        stats = client.get("/v2/models/encoder/stats").json()["model_stats"][0]
        assert stats["live_parity"]["checked"] == sent


@pytest.fixture(scope="module")
def skewed(tiny_artifact, tmp_path_factory):
    return skew_gamma(tiny_artifact, tmp_path_factory.mktemp("skewed") / "artifact")


@pytest.mark.parametrize("variant", ["int8", "fp16", "packed"])
def test_a_skewed_gamma_is_caught_in_a_lossy_variant_too(every_variant, tmp_path, variant, every_sample_kept):
    """The lossy variants' allowance is their own arithmetic's error, not a blank cheque: a 5% gamma is caught
    in each within 20 requests; and in a packed graph."""
    art = skew_gamma(every_variant / variant, tmp_path / "artifact")
    with TestClient(_app(art, verify_on_load="warn")) as client:
        wait_until_ready(client)
        model = f"encoder-{variant}"
        x = np.random.default_rng(1).standard_normal((1, 4, E)).tolist()
        for _ in range(20):
            assert client.post("/v1/encode", json={"embeddings": x, "model": model}).status_code == 200
        wait_until(lambda: _counts(client, model)["checked"] == 20, 300, "20 checked")
        counts = _counts(client, model)
        assert counts["failed"] >= 1 and counts["worst_ratio"] > 1, counts


def test_a_skewed_gamma_is_caught_and_with_unready_the_model_leaves_service(skewed):
    settings = {"verify_on_load": "warn", "live_parity_action": "unready", "live_parity_failures": 3}
    with TestClient(_app(skewed, **settings)) as client:
        wait_until_ready(client)
        x = np.random.default_rng(1).standard_normal((1, 4, E)).tolist()
        statuses = [client.post("/v1/encode", json={"embeddings": x}).status_code for _ in range(20)]
        assert statuses[0] == 200
        wait_until(
            lambda: client.get("/health/ready").status_code == 503, 300, "the model taken out of service"
        )
        reason = client.get("/health/ready").json()["error"]
        assert "live parity" in reason and "failed the parity rule" in reason
        r = client.post("/v1/encode", json={"embeddings": x})
        assert r.status_code == 503 and "live parity" in r.json()["error"]
        index = client.post("/v2/repository/index").json()
        assert index[0]["state"] == "UNAVAILABLE" and "live parity" in index[0]["reason"]


def test_warn_only_counts_and_logs(skewed, caplog):
    with TestClient(_app(skewed, verify_on_load="warn")) as client:
        wait_until_ready(client)
        x = np.random.default_rng(2).standard_normal((1, 4, E)).tolist()
        for _ in range(5):
            assert client.post("/v1/encode", json={"embeddings": x}).status_code == 200
        wait_until(lambda: _counts(client)["checked"] == 5, 300, "5 samples checked")
        assert _counts(client)["failed"] == 5 and _counts(client)["worst_ratio"] > 1
        assert client.get("/health/ready").status_code == 200  # warn: still in service
    lines = [r.getMessage() for r in caplog.records if "live parity FAILED" in r.getMessage()]
    assert lines and "encoder" in lines[0] and "[1, 4, 32]" in lines[0]


def test_a_full_queue_drops_and_counts_and_never_blocks(tiny_artifact, monkeypatch):
    held = threading.Event()
    real = LiveParity.check

    def slow(self, sample):
        held.wait(30)
        return real(self, sample)

    monkeypatch.setattr(LiveParity, "check", slow)
    with TestClient(_app(tiny_artifact)) as client:
        wait_until_ready(client)
        x = np.zeros((1, 2, E)).tolist()
        n = QUEUE + 12
        assert all(client.post("/v1/encode", json={"embeddings": x}).status_code == 200 for _ in range(n))
        counts = _counts(client)
        assert counts["dropped"] >= n - QUEUE - 1 and counts["checked"] == 0, (
            counts
        )  # one in the checker's hands
        held.set()
        wait_until(
            lambda: _counts(client)["checked"] + _counts(client)["dropped"] == n, 300, "the queue drained"
        )


def test_a_request_too_big_for_the_checker_is_not_sampled(tiny_artifact, monkeypatch):
    """The reference holds seq x seq scores in float64: a request above MAX_SCORES is never copied (one
    [1, 4096, 768] request would take 1.6 GB of the server's memory)."""
    from addnorm.service.models import live_parity

    monkeypatch.setattr(live_parity, "MAX_SCORES", 4 * 4 * 4)  # tiny model: 4 heads; [1, 4] fits, [1, 5] not
    with TestClient(_app(tiny_artifact)) as client:
        wait_until_ready(client)
        for seq in (4, 5):
            assert (
                client.post("/v1/encode", json={"embeddings": np.zeros((1, seq, E)).tolist()}).status_code
                == 200
            )
        wait_until(lambda: _counts(client)["checked"] == 1, 300, "the small one checked")
        assert _counts(client) | {"worst_ratio": 0} == {
            "checked": 1,
            "failed": 0,
            "dropped": 0,
            "errors": 0,
            "worst_ratio": 0,
            "judged": True,
        }


def test_the_heap_is_trimmed_only_after_a_large_sample(tiny_artifact, monkeypatch):
    """malloc_trim walks and locks every malloc arena the request path allocates from: the checker calls it only
    after a sample whose float64 temporaries are worth giving back (TRIM_AFTER_ELEMENTS), not after every one."""
    from addnorm.service.backend import engine
    from addnorm.service.models import live_parity

    trims = []
    monkeypatch.setattr(engine, "trim", lambda: trims.append(1))
    monkeypatch.setattr(live_parity, "TRIM_AFTER_ELEMENTS", 6 * E)  # [1, 6, 32] and larger
    with TestClient(_app(tiny_artifact)) as client:
        wait_until_ready(client)
        for seq in (2, 3, 4, 8):
            body = {"embeddings": np.zeros((1, seq, E)).tolist()}
            assert client.post("/v1/encode", json=body).status_code == 200
        wait_until(lambda: _counts(client)["checked"] == 4, 300, "four samples checked")
    assert len(trims) == 1


def test_a_checker_that_cannot_run_counts_errors_and_says_why(tiny_artifact, tmp_path, caplog):
    """Without the weights (the artifact copied without weights.safetensors) the checker cannot recompute an
    answer: each sample is counted as an error, in /v1/model and /metrics, and logged, so that checked 0 and
    failed 0 never read as all well (seen on a GPU machine, where the weights had not been copied)."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_artifact, bare)
    (bare / "weights.safetensors").unlink()
    with TestClient(_app(bare)) as client:
        wait_until_ready(client)  # serving needs no weights
        x = np.zeros((1, 3, E)).tolist()
        for _ in range(3):
            assert client.post("/v1/encode", json={"embeddings": x}).status_code == 200
        wait_until(lambda: _counts(client)["errors"] == 3, 300, "three errors counted")
        assert _counts(client)["checked"] == 0 and _counts(client)["failed"] == 0
        assert 'addnorm_live_parity_errors_total{model="encoder"} 3.0' in client.get("/metrics").text
    lines = [r.getMessage() for r in caplog.records if "failed to run" in r.getMessage()]
    assert lines and "encoder" in lines[0]
