"""Several models in one server: names from manifests, per-model readiness, statistics, the repository index."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import tritonclient.http as th
from fastapi.testclient import TestClient

from addnorm.service import cli, create_app
from addnorm.service.models import state
from addnorm.service.settings import Settings
from tests.conftest import REPO_KEY

E = 32
AUTH = {"Authorization": f"Bearer {REPO_KEY}"}


def started(settings: Settings) -> TestClient:
    """A started app whose every model has settled, READY or UNAVAILABLE (exit it with ``__exit__``)."""
    client = TestClient(create_app(settings))
    client.__enter__()
    deadline = time.monotonic() + 30
    while (r := client.post("/v2/repository/index")).status_code != 200 or any(
        m["state"] == "LOADING" for m in r.json()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return client


@pytest.fixture(scope="module")
def two(model_repository):
    client = started(Settings(model_repository=model_repository))
    yield client
    client.__exit__(None, None, None)


def _v2(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {"name": "embeddings", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def test_names_come_from_manifests_and_the_first_is_the_default(two):
    ready = two.get("/health/ready").json()
    assert ready["model"] == "encoder" and sorted(ready["models"]) == ["encoder", "encoder-int8"]
    assert two.get("/v1/model").json()["name"] == "encoder"
    assert two.get("/v1/model", params={"model": "encoder-int8"}).json()["variant"] == "int8"
    index = two.post("/v2/repository/index").json()
    assert [(m["name"], m["state"]) for m in index] == [("encoder", "READY"), ("encoder-int8", "READY")]
    assert two.post("/v2/repository/index", json={"ready": True}).json() == index
    assert two.post("/v2/repository/index", json={"ready": "yes"}).status_code == 400


def test_v1_encode_picks_the_model_by_body_or_query(two):
    x = np.random.default_rng(3).standard_normal((4, E)).astype(np.float32)
    default = two.post("/v1/encode", json={"embeddings": x.tolist()}).json()
    fp32 = two.post("/v1/encode", json={"embeddings": x.tolist(), "model": "encoder"}).json()
    int8 = two.post("/v1/encode", json={"embeddings": x.tolist(), "model": "encoder-int8"}).json()
    assert default == fp32 and fp32["model"] == "encoder" and int8["model"] == "encoder-int8"
    assert np.abs(np.array(fp32["encoded"]) - np.array(int8["encoded"])).max() > 1e-2
    raw = two.post(
        "/v1/encode?model=encoder-int8",
        content=x.tobytes(),
        headers={
            "Content-Type": "application/octet-stream",
            "X-Shape": f"4,{E}",
            "Accept": "application/json",
        },
    ).json()
    np.testing.assert_allclose(raw["encoded"], int8["encoded"], rtol=0, atol=1e-6)
    r = two.post("/v1/encode", json={"embeddings": x.tolist(), "model": "nope"})
    assert r.status_code == 404 and "encoder-int8" in r.json()["error"]
    r = two.post("/v1/encode?model=encoder", json={"embeddings": x.tolist(), "model": "encoder-int8"})
    assert r.status_code == 400 and "query names" in r.json()["error"]
    assert two.post("/v1/encode", json={"embeddings": x.tolist(), "model": 3}).status_code == 400


def test_metrics_are_per_model(two):
    assert (
        two.post("/v2/models/encoder-int8/infer", json=_v2(np.ones((1, 2, E), np.float32))).status_code == 200
    )
    text = two.get("/metrics").text
    assert 'addnorm_batch_size_count{model="encoder-int8"} ' in text
    assert 'addnorm_queue_depth{model="encoder"} ' in text


def test_one_model_failing_leaves_the_other_serving(tiny_artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_artifact, broken)
    manifest = (broken / "manifest.json").read_text().replace('"name": "encoder"', '"name": "broken"', 1)
    (broken / "manifest.json").write_text(manifest)
    (broken / "model.onnx").write_bytes(b"not the graph the manifest describes")
    client = started(Settings(artifact=[tiny_artifact, broken]))
    x = _v2(np.ones((1, 2, E), np.float32))
    try:
        r = client.get("/health/ready")
        assert r.status_code == 503 and "model 'broken' failed to load" in r.json()["error"]
        assert "sha256" in r.json()["error"]
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get("/v2/models/encoder/ready").status_code == 200
        r = client.get("/v2/models/broken/ready")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]
        assert client.post("/v2/models/encoder/infer", json=x).status_code == 200
        assert client.post("/v2/models/broken/infer", json=x).status_code == 503
        index = {m["name"]: m for m in client.post("/v2/repository/index").json()}
        assert index["encoder"]["state"] == "READY" and index["broken"]["state"] == "UNAVAILABLE"
        assert "sha256" in index["broken"]["reason"]
        assert [m["name"] for m in client.get("/v2/models/stats").json()["model_stats"]] == ["encoder"]
        assert client.get("/v2/models/broken/stats").status_code == 503
    finally:
        client.__exit__(None, None, None)


def test_models_load_in_parallel(model_repository, monkeypatch):
    """Each load waits at a barrier for the other: loaded one after the other, neither would get past it."""
    barrier = threading.Barrier(2, timeout=20)
    real = state.Engine

    def engine(*args, **kwargs):
        barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(state, "Engine", engine)
    client = started(Settings(model_repository=model_repository))
    try:
        assert client.get("/health/ready").status_code == 200
    finally:
        client.__exit__(None, None, None)


def test_two_models_of_one_name_refuse_to_start(tiny_artifact, tmp_path, capsys):
    twin = tmp_path / "twin"
    shutil.copytree(tiny_artifact, twin)
    assert cli.main(["--artifact", str(tiny_artifact), "--artifact", str(twin), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "two models are named 'encoder'" in err and str(tiny_artifact) in err and str(twin) in err
    assert cli.main(["--model-repository", str(tmp_path / "none"), "--port", "0"]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_statistics_with_tritonclient_http(repo_server):
    client = th.InferenceServerClient(f"127.0.0.1:{repo_server.port}")

    def stats(name: str) -> dict:
        return client.get_inference_statistics(name, headers=dict(AUTH))["model_stats"][0]

    # a fresh headers dict per call: tritonclient.http writes Inference-Header-Content-Length into the one it gets
    before = stats("encoder-int8")
    x = np.ones((2, 5, E), np.float32)
    for binary in (True, False):
        i = th.InferInput("embeddings", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=binary)
        client.infer("encoder-int8", [i], headers=dict(AUTH))
    bad = th.InferInput("embeddings", [1, 5, 3], "FP32")
    bad.set_data_from_numpy(np.ones((1, 5, 3), np.float32))
    with pytest.raises(Exception, match="d_model"):
        client.infer("encoder-int8", [bad], headers=dict(AUTH))
    after = stats("encoder-int8")
    s0, s1 = before["inference_stats"], after["inference_stats"]
    assert s1["success"]["count"] - s0["success"]["count"] == 2
    assert s1["fail"]["count"] - s0["fail"]["count"] == 1
    assert after["inference_count"] - before["inference_count"] == 4  # rows
    assert after["execution_count"] - before["execution_count"] == 2
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert s1[stage]["count"] - s0[stage]["count"] == 2 and s1[stage]["ns"] > s0[stage]["ns"]
    assert after["last_inference"] > 0
    assert any(b["batch_size"] == 2 and b["compute_infer"]["count"] >= 2 for b in after["batch_stats"])
    assert "statistics" in client.get_server_metadata(headers=dict(AUTH))["extensions"]
    index = client.get_model_repository_index(headers=dict(AUTH))
    assert [m["name"] for m in index] == ["encoder", "encoder-int8"]
    versioned = client.get_inference_statistics("encoder", "1", headers=dict(AUTH))["model_stats"][0]
    assert versioned["name"] == "encoder"
    with pytest.raises(Exception, match="unknown version"):
        client.get_inference_statistics("encoder", "2", headers=dict(AUTH))
    with pytest.raises(Exception, match="API key"):
        client.get_inference_statistics("encoder")


def _quiet_log(capsys) -> None:
    """Lines an earlier test's server queued on the log writer are written now and dropped: the output read next
    is this test's command's alone."""
    from addnorm.service import logs

    logs.flush()
    capsys.readouterr()


def test_a_taken_grpc_port_refuses_to_start_before_loading(tiny_artifact, capsys):
    import socket

    _quiet_log(capsys)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--artifact", str(tiny_artifact), "--port", "0", "--grpc-port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot serve gRPC on 127.0.0.1:{port}" in err and "0 to turn gRPC off" in err


def test_a_taken_http_port_refuses_in_one_line_before_loading(tiny_artifact, capsys):
    """Issue 27: it used to log "serving on ...", then uvicorn's [Errno 98], load the models and exit 3."""
    import logging
    import socket

    from addnorm.service import logs

    _quiet_log(capsys)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--artifact", str(tiny_artifact), "--port", str(port), "--grpc-port", "0"]) == 1
    logs.flush()  # the server's log lines go through its writer thread (addnorm does not propagate to caplog)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot serve HTTP on 127.0.0.1:{port}" in err, err
    assert "--port (ADDNORM_PORT; under make: make serve PORT=N)" in err
    assert "serving on" not in err
    # and a line the server logs does reach this capture
    logging.getLogger("addnorm.serve").info("serving on nothing: the capture works")
    logs.flush()
    assert "serving on nothing" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, env, want",
    [
        (["--port", "abc"], {}, "--port (ADDNORM_PORT): input should be a valid integer"),
        (
            ["--port", "70000"],
            {},
            "--port (ADDNORM_PORT): input should be less than or equal to 65535, got '70000'",
        ),
        (
            ["--max-batch-size", "-1"],
            {},
            "--max-batch-size (ADDNORM_MAX_BATCH_SIZE): input should be greater",
        ),
        (
            [],
            {"ADDNORM_MAX_BATCH_SIZE": "abc"},
            "--max-batch-size (ADDNORM_MAX_BATCH_SIZE): input should be a valid",
        ),
        (["--providers", "gpu"], {}, "argument --providers: invalid choice: 'gpu'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_flag_and_the_variable(args, env, want, capsys, monkeypatch):
    _quiet_log(capsys)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:  # argparse's own refusals exit (2) from inside main; the settings' are main's return value
        code = cli.main(args)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err and "pydantic" not in err, err
