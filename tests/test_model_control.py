"""Model control (issue 25): load, reload and unload while serving, with tritonclient over both transports.

The repository holds Triton's layout, ``encoder/1`` (seed 0); version 2 (seed 1, other answers) and a version 3
whose graph is tampered with (its sha256 no longer matches) are added while 8 clients keep asking. Every answer
must come from the version it names (``model_version``) and equal that version's graph run in-process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from addnorm.model.artifact import sha256_file
from bench.server import ServerProcess
from tests.conftest import TINY, export_to
from tests.helpers import wait_until

E = TINY.d_model
X = np.random.default_rng(7).standard_normal((1, 3, E)).astype(np.float32)


@pytest.fixture(scope="module")
def versions(tiny_artifact, tmp_path_factory) -> dict[str, Path]:
    """Three candidate versions of "encoder": seed 0, seed 1, and seed 1 with a tampered graph."""
    root = tmp_path_factory.mktemp("versions")
    second = export_to(root / "second", TINY, seed=1)
    bad = root / "bad"
    shutil.copytree(second, bad)
    graph = bytearray((bad / "model.onnx").read_bytes())
    graph[-1] ^= 0xFF
    (bad / "model.onnx").write_bytes(bytes(graph))
    return {"1": tiny_artifact, "2": second, "bad": bad}


def reference(artifact: Path) -> np.ndarray:
    sess = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(["encoded"], {"embeddings": X, "mask": np.zeros(X.shape[:2], bool)})[0]


def repository(tmp_path: Path, versions: dict[str, Path], *which: str) -> Path:
    repo = tmp_path / "repo"
    for v in which:
        shutil.copytree(versions[v], repo / "encoder" / v)
    return repo


class Clients:
    """8 clients (4 tritonclient.http, 4 tritonclient.grpc) asking in a loop until stopped; every answer is
    checked against the version that served it."""

    def __init__(self, srv, expected: dict[str, np.ndarray]) -> None:
        self.srv, self.expected = srv, expected
        self.seen: dict[str, int] = {}
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(kind,)) for kind in ["http", "grpc"] * 4]

    def _loop(self, kind: str) -> None:
        if kind == "http":
            client, mod = httpclient.InferenceServerClient(f"127.0.0.1:{self.srv.port}"), httpclient
        else:
            client, mod = grpcclient.InferenceServerClient(f"127.0.0.1:{self.srv.grpc_port}"), grpcclient
        inp = mod.InferInput("embeddings", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        deadline = time.monotonic() + 120
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                result = client.infer("encoder", [inp])
                version = (
                    result.get_response()["model_version"]
                    if kind == "http"
                    else result.get_response().model_version
                )
                got = result.as_numpy("encoded")
                ok = version in self.expected and np.allclose(
                    got, self.expected[version], rtol=1e-4, atol=1e-5
                )
                with self.lock:
                    self.seen[version] = self.seen.get(version, 0) + 1
                    if not ok:
                        self.failures.append(f"{kind}: version {version} answered something else")
            except InferenceServerException as exc:
                with self.lock:
                    self.failures.append(f"{kind}: {exc}")
        client.close()

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def count(self, version: str) -> int:
        with self.lock:
            return self.seen.get(version, 0)


def control_server(repo: Path, mode: str, *flags: str, grpc: bool = False) -> ServerProcess:
    return ServerProcess(
        ["-m", "addnorm.service", "--model-repository", str(repo), "--model-control-mode", mode, *flags],
        grpc=grpc,
    )


def _index(srv) -> dict:
    [entry] = httpx.post(f"{srv.base}/v2/repository/index", timeout=10).json()
    return entry


def test_a_reload_under_load_swaps_versions_with_no_failed_request_and_refuses_a_bad_one(tmp_path, versions):
    repo = repository(tmp_path, versions, "1")
    expected = {"1": reference(versions["1"]), "2": reference(versions["2"])}
    with (
        control_server(repo, "explicit", "--load-model", "encoder", grpc=True) as srv,
        Clients(srv, expected) as clients,
    ):
        http = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        wait_until(lambda: clients.count("1") >= 20, 60, "20 answers from version 1")
        assert _index(srv) == {"name": "encoder", "version": "1", "state": "READY", "reason": ""}

        shutil.copytree(versions["2"], repo / "encoder" / "2")
        http.load_model("encoder")  # returns once version 2 is verified and takes traffic
        assert _index(srv)["version"] == "2"
        served_before = clients.count("2")
        wait_until(lambda: clients.count("2") >= served_before + 20, 60, "20 answers from version 2")

        shutil.copytree(versions["bad"], repo / "encoder" / "3")
        with pytest.raises(InferenceServerException) as info:
            grpc.load_model("encoder")
        assert "version 3" in str(info.value) and "sha256" in str(info.value)
        entry = _index(srv)
        assert entry["state"] == "READY" and entry["version"] == "2"
        assert "version 3" in entry["reason"] and "version 2 still serves" in entry["reason"]
        after_refusal = clients.count("2")
        wait_until(lambda: clients.count("2") >= after_refusal + 20, 60, "version 2 still answering")
    assert clients.failures == [], clients.failures[:5]
    assert set(clients.seen) == {"1", "2"}, clients.seen  # never the refused version


def test_unload_drains_and_load_brings_it_back(tmp_path, versions):
    repo = repository(tmp_path, versions, "1")
    # Requests wait in the queue for company (for two minutes, far beyond the test's timeouts) until five rows
    # fill a batch: all four are in flight when the unload comes, however slowly they arrive, and the unload runs
    # them at once (Batcher.drain) instead of after the wait. (A 300 ms wait failed when they arrived slower.)
    flags = ["--load-model", "encoder", "--max-queue-delay-ms", "120000", "--max-batch-size", "5"]
    with control_server(repo, "explicit", *flags, grpc=True) as srv:
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        doc = {
            "inputs": [
                {"name": "embeddings", "shape": [1, 3, E], "datatype": "FP32", "data": X.ravel().tolist()}
            ]
        }
        results: list[int] = []

        def ask() -> None:
            results.append(
                httpx.post(f"{srv.base}/v2/models/encoder/infer", json=doc, timeout=30).status_code
            )

        askers = [threading.Thread(target=ask) for _ in range(4)]
        for t in askers:
            t.start()
        wait_until(lambda: "addnorm_queue_depth{model=\"encoder\"} 4.0" in httpx.get(f"{srv.base}/metrics").text,
                   30, "4 requests queued")  # fmt: skip
        grpc.unload_model("encoder", client_timeout=30)  # returns once the 4 in flight are answered
        for t in askers:
            t.join(30)
        assert results == [200] * 4
        r = httpx.post(f"{srv.base}/v2/models/encoder/infer", json=doc, timeout=30)
        assert r.status_code == 503 and "unloaded" in r.json()["error"]
        assert (
            _index(srv)["state"] == "UNAVAILABLE" and httpx.get(f"{srv.base}/health/ready").status_code == 200
        )
        grpc.load_model("encoder")
        five = np.repeat(X, 5, axis=0)  # a full batch: runs without waiting for company
        full = {"inputs": [{"name": "embeddings", "shape": list(five.shape), "datatype": "FP32",
                            "data": five.ravel().tolist()}]}  # fmt: skip
        assert httpx.post(f"{srv.base}/v2/models/encoder/infer", json=full, timeout=30).status_code == 200
        with pytest.raises(InferenceServerException, match="no model 'nope' in the repository"):
            grpc.load_model("nope")


def test_poll_mode_picks_up_a_new_version_directory(tmp_path, versions):
    repo = repository(tmp_path, versions, "1")
    with control_server(repo, "poll", "--repository-poll-secs", "0.2") as srv:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")
        assert _index(srv)["version"] == "1"
        with pytest.raises(InferenceServerException, match="not allowed"):  # the poller decides, not clients
            http.load_model("encoder")
        shutil.copytree(versions["2"], repo / "encoder" / "2")
        wait_until(lambda: _index(srv)["version"] == "2", 60, "the poller loading version 2")
        inp = httpclient.InferInput("embeddings", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        np.testing.assert_allclose(
            http.infer("encoder", [inp]).as_numpy("encoded"), reference(versions["2"]), rtol=1e-4, atol=1e-5
        )
        shutil.rmtree(repo / "encoder")
        wait_until(lambda: _index(srv)["state"] == "UNAVAILABLE", 60, "the poller unloading a removed model")


def test_with_model_control_off_a_server_with_no_loadable_model_exits_non_zero(tmp_path, versions):
    """Triton's exit-on-error: the golden check fails (the golden data of another model, re-hashed into the
    manifest: version 1's graph does not give version 2's recorded answers), nothing can be served, and the
    process says so in one line and exits 1 instead of answering 503 for ever."""
    art = tmp_path / "art"
    shutil.copytree(versions["1"], art)
    golden = versions["2"] / "golden.safetensors"
    shutil.copyfile(golden, art / "golden.safetensors")
    manifest = json.loads((art / "manifest.json").read_text())
    for key, _value in list(manifest.items()):
        if key.startswith("golden") and "sha256" in key:
            manifest[key] = sha256_file(art / "golden.safetensors")
    (art / "manifest.json").write_text(json.dumps(manifest))
    srv = ServerProcess(["-m", "addnorm.service", "--artifact", str(art)])
    try:
        assert srv.proc.wait(120) == 1, srv.output()[-2000:]
        lines = [line for line in srv.output().splitlines() if "no model can be served" in line]
        assert len(lines) == 1 and "golden check failed" in lines[0], srv.output()[-2000:]
    finally:
        srv.stop()


def test_control_refusals_over_http_and_unload_by_http(tmp_path, versions):
    """Triton's repository API over HTTP: refused where control is off (saying how to turn it on), parameters it
    does not take refused by name (tritonclient's unload_dependents taken), unload and load by HTTP."""
    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from addnorm.service.settings import Settings
    from tests.helpers import wait_until_ready

    repo = repository(tmp_path, versions, "1")
    with TestClient(create_app(Settings(model_repository=repo))) as c:  # --model-control-mode none
        wait_until_ready(c)
        r = c.post("/v2/repository/models/encoder/load", json={})
        assert 400 <= r.status_code < 500 and "--model-control-mode explicit" in r.json()["error"], r.text
    settings = Settings(model_repository=repo, model_control_mode="explicit", load_model=("encoder",))
    with TestClient(create_app(settings)) as c:
        wait_until_ready(c)
        r = c.post("/v2/repository/models/encoder/load", json={"parameters": {"config": "{}"}})
        assert r.status_code == 400 and "load parameters ['config'] are not supported" in r.json()["error"], (
            r.text
        )
        r = c.post("/v2/repository/models/encoder/unload", json={"parameters": {"force": True}})
        assert r.status_code == 400 and "unload parameters ['force']" in r.json()["error"], r.text
        r = c.post("/v2/repository/models/encoder/unload", json={"parameters": {"unload_dependents": False}})
        assert r.status_code == 200, r.text
        index = {m["name"]: m for m in c.post("/v2/repository/index", json={}).json()}
        assert index["encoder"]["state"] == "UNAVAILABLE"
        assert c.post("/v2/repository/models/encoder/load", json={}).status_code == 200
        infer = {
            "inputs": [
                {"name": "embeddings", "shape": [1, 3, E], "datatype": "FP32", "data": X.ravel().tolist()}
            ]
        }
        assert c.post("/v2/models/encoder/infer", json=infer).status_code == 200


def test_a_reload_of_an_unreadable_manifest_is_refused_naming_why(tmp_path, versions):
    """A new version whose manifest.json is half-written (an export killed mid-write, say): the load is refused
    with a 4xx that names the directory and why (it answered "no model 'encoder' in the repository" before, the
    cause only in the server's log), and the version serving goes on."""
    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from addnorm.service.settings import Settings
    from tests.helpers import wait_until_ready

    repo = repository(tmp_path, versions, "1")
    settings = Settings(model_repository=repo, model_control_mode="explicit", load_model=("encoder",))
    with TestClient(create_app(settings)) as c:
        wait_until_ready(c)
        shutil.copytree(versions["2"], repo / "encoder" / "2")
        manifest = repo / "encoder" / "2" / "manifest.json"
        manifest.write_bytes(manifest.read_bytes()[:100])
        r = c.post("/v2/repository/models/encoder/load", json={})
        assert r.status_code == 400, r.text
        assert str(repo / "encoder" / "2") in r.json()["error"] and "not valid JSON" in r.json()["error"], (
            r.text
        )
        r = c.post("/v2/repository/models/nothing/load", json={})
        assert r.status_code == 404 and "no model 'nothing'" in r.json()["error"], r.text
        index = {m["name"]: m for m in c.post("/v2/repository/index", json={}).json()}
        assert index["encoder"]["state"] == "READY" and index["encoder"]["version"] == "1"


def test_control_is_refused_before_the_manifests_are_read(tmp_path, versions):
    import asyncio

    from addnorm.service.errors import ControlOff
    from addnorm.service.models.control import ModelControl
    from addnorm.service.settings import Settings

    repo = repository(tmp_path, versions, "1")
    control = ModelControl(Settings(model_repository=repo, model_control_mode="explicit"), lambda: None)
    for call in (control.load, control.unload):
        with pytest.raises(ControlOff, match="still reading its models' manifests"):
            asyncio.run(call("encoder"))


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--workers", "2"], "model control loads models in one process: use --workers 1 with it"),
        (["--artifact", "{art}"], "--model-control-mode explicit loads models from a repository"),
    ],
)
def test_control_settings_that_cannot_work_are_refused_at_start(tmp_path, versions, capsys, flags, said):
    from addnorm.service import cli, logs

    repo = repository(tmp_path, versions, "1")
    args = [f.format(art=versions["1"]) for f in flags] + ["--model-control-mode", "explicit", "--port", "0"]
    if "--artifact" not in flags:
        args += ["--model-repository", str(repo)]
    logs.flush()  # lines an earlier test's server queued are written now, and dropped: not this command's
    capsys.readouterr()
    assert cli.main(args) == 1
    logs.flush()
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("protocol", ["v2", "v1"])
def test_a_model_swapped_while_a_large_body_is_decoded_decodes_and_serves_it_with_one_version(
    tmp_path, versions, monkeypatch, protocol
):
    """A body of more work than inference.OFFLOAD_BYTES (2.6 MB of JSON) is decoded in a worker thread; version 2
    is loaded (a verified swap) while that decode is held. The request is decoded against the model that then
    serves it: V2 names the model in its path, looked up once before the body is read (version 1's manifest
    decodes it and version 1 serves it to its end); /v1 names it in its payload, looked up by the decode itself
    (version 2, after the swap)."""
    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from addnorm.service.core import inference
    from addnorm.service.protocols.v1 import codec as v1_codec
    from addnorm.service.protocols.v2 import codec as v2_codec
    from addnorm.service.settings import Settings
    from tests.helpers import wait_until_ready

    repo = repository(tmp_path, versions, "1")
    x = np.random.default_rng(3).standard_normal((1, 4096, E)).astype(np.float32)  # as JSON: decoded off-loop
    held, release, manifests = threading.Event(), threading.Event(), []
    module, attr = (v2_codec, "decode_infer") if protocol == "v2" else (v1_codec, "decode")
    real = getattr(module, attr)

    def traced_decode(*args, **kwargs):
        if protocol == "v2":
            manifests.append(args[2])  # decode_infer(body, header_length, manifest, max_elements)
        return real(*args, **kwargs)

    worker = inference.in_worker

    async def held_worker(fn, *args):  # the decode's turn in a worker thread comes after the swap
        held.set()
        await asyncio.to_thread(release.wait, 30)
        return await worker(fn, *args)

    monkeypatch.setattr(module, attr, traced_decode)
    monkeypatch.setattr(inference, "in_worker", held_worker)
    app = create_app(Settings(model_repository=repo, model_control_mode="explicit", load_model=("encoder",)))
    with TestClient(app) as client:
        wait_until_ready(client)
        models = app.state.addnorm.known.models
        first = models.get("encoder")
        answer: dict = {}

        def send() -> None:
            if protocol == "v2":
                tensor = {"name": "embeddings", "shape": list(x.shape), "datatype": "FP32"}
                r = client.post(
                    "/v2/models/encoder/infer", json={"inputs": [{**tensor, "data": x.ravel().tolist()}]}
                )
                answer.update(status=r.status_code, doc=r.json() if r.status_code == 200 else r.text)
            else:
                r = client.post("/v1/encode", json={"embeddings": x[0].tolist()})
                answer.update(status=r.status_code, doc=r.json() if r.status_code == 200 else r.text)

        sender = threading.Thread(target=send)
        sender.start()
        assert held.wait(30), "the decode never started"
        shutil.copytree(versions["2"], repo / "encoder" / "2")
        assert client.post("/v2/repository/models/encoder/load").status_code == 200
        second = models.get("encoder")
        assert second is not first and second.version == "2"
        release.set()
        sender.join(60)
    assert answer["status"] == 200, answer
    doc = answer["doc"]
    if protocol == "v2":
        assert manifests == [first.engine.manifest]  # not the manifest of the version swapped in meanwhile
        assert doc["model_version"] == "1"
        got = np.array(doc["outputs"][0]["data"], np.float32).reshape(x.shape)
        version = "1"
    else:
        got = np.array(doc["encoded"], np.float32)
        version = "2"
    want = ort.InferenceSession(str(versions[version] / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = want.run(["encoded"], {"embeddings": x, "mask": np.zeros(x.shape[:2], bool)})[0]
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
