"""--workers N: uvicorn's worker processes, each building the app from the settings it is handed through the
environment (Settings.to_env, create_app as a factory)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort

from addnorm.service.settings import Settings
from tests.conftest import start_server


def test_settings_survive_the_environment(tmp_path, monkeypatch):
    """Every setting a worker needs arrives as it was given: tuples, secrets, paths, numbers, flags."""
    given = Settings(
        artifact=(tmp_path / "a", tmp_path / "b"),
        api_key="k1,k2",
        model_threads=("a=1", "b=2"),
        max_batch_size=7,
        max_queue_delay_ms=3.5,
        verify_on_load="warn",
        workers=3,
    )
    for name, value in given.to_env().items():
        monkeypatch.setenv(name, value)
    again = Settings()
    assert again.model_dump() == given.model_dump()
    assert again.api_keys() == ("k1", "k2")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _every_worker_ready(base: str, in_a_row: int = 16, timeout: float = 60.0) -> None:
    """The server is ready once one worker is: wait until ``in_a_row`` probes on new connections in a row (the
    kernel spreads them over the workers; all on one of two workers by chance: 2**-15) answer 200, so that no
    request below meets a worker still loading its model (503, "is loading")."""
    deadline, ok = time.monotonic() + timeout, 0
    while ok < in_a_row:
        assert time.monotonic() < deadline, "the workers never all became ready"
        ok = ok + 1 if httpx.get(f"{base}/health/ready", timeout=10).status_code == 200 else 0
        if not ok:
            time.sleep(0.1)


def test_two_workers_serve_with_the_settings_they_were_given(tiny_artifact):
    """Two worker processes, each with the API key and the model: unauthenticated requests are refused, an
    authenticated one is answered as in-process onnxruntime answers it, whichever worker takes it."""
    x = np.random.default_rng(4).standard_normal((1, 3, 32)).astype(np.float32)
    session = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(["encoded"], {"embeddings": x, "mask": np.zeros((1, 3), bool)})[0]
    with start_server(tiny_artifact, "--workers", "2", "--api-key", "sekrit") as srv:
        workers = [c for c in _children(srv.proc.pid) if Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) >= 2, workers  # (uvicorn may add a helper process of its own)
        _every_worker_ready(srv.base)
        body = {"embeddings": x.tolist()}
        with httpx.Client(base_url=srv.base, timeout=30) as client:
            for _ in range(8):  # new connections: the kernel spreads them over the workers
                assert httpx.post(f"{srv.base}/v1/encode", json=body, timeout=30).status_code == 401
                r = httpx.post(
                    f"{srv.base}/v1/encode", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=30
                )
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(r.json()["encoded"], want, atol=1e-5, rtol=0)
            assert client.get("/health/ready").status_code == 200


def test_each_worker_shares_its_thread_budget_among_its_models(tiny_artifact, tmp_path):
    """--workers 2 --thread-budget 4 with two models: each worker's budget is 4 threads (the cores split among
    workers is the default budget, state.cores), and each of its two models gets an equal share, 2 (the server
    used to set every model's threads to the whole per-worker budget whenever --workers > 1)."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_artifact, other)
    manifest = (other / "manifest.json").read_text().replace('"name": "encoder"', '"name": "second"', 1)
    (other / "manifest.json").write_text(manifest)
    flags = ["--workers", "2", "--thread-budget", "4", "--artifact", str(other)]
    with start_server(tiny_artifact, *flags) as srv:
        _every_worker_ready(srv.base)
        deadline = time.monotonic() + 60
        while srv.output().count("intra-op threads") < 4:  # two models in each of two workers
            assert time.monotonic() < deadline, srv.output()[-3000:]
            time.sleep(0.1)
        lines = [line for line in srv.output().splitlines() if "intra-op threads" in line]
        assert len(lines) == 4 and all("with 2 intra-op threads" in line for line in lines), lines
