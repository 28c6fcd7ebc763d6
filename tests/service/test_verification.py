"""Parity where it is served: the golden inputs run at load on this server's session, judged by the gate's rule."""

import contextlib
import json
import shutil
import time

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import numpy_helper

from addnorm.model.artifact import GOLDEN_FILE, MODEL_FILE, sha256_file
from addnorm.model.golden import load_golden, save_golden
from addnorm.service import create_app
from addnorm.service.settings import Settings


@contextlib.contextmanager
def start(model_dir, mode="strict"):
    """A started app: ready, or settled on why it is not."""
    with TestClient(create_app(Settings(artifact=model_dir, verify_on_load=mode))) as client:
        deadline = time.monotonic() + 30
        while (r := client.get("/health/ready")).status_code != 200:
            if "failed" in r.json()["error"] or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        yield client


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(art, **changes):
    doc = json.loads((art / "manifest.json").read_text())
    doc.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del doc[key]
    (art / "manifest.json").write_text(json.dumps(doc))


def test_a_fresh_artifact_verifies_on_its_provider(tiny_artifact):
    assert (tiny_artifact / GOLDEN_FILE).is_file()
    with start(tiny_artifact) as client:
        v = client.get("/v1/model").json()["verification"]
        assert v["status"] == "passed" and v["provider"] == "CPUExecutionProvider" and v["cases"] == 3
        assert v["max_abs_err"] <= 1e-5 and v["tolerance"]["atol"] == 1e-5 and v["at"]
        assert client.get("/v2/models/encoder").json()["parameters"]["verification"]["status"] == "passed"
        assert 'addnorm_golden_verified{model="encoder"} 1.0' in client.get("/metrics").text


@pytest.fixture
def skewed(tiny_artifact, tmp_path):
    """The artifact with one LayerNorm gamma scaled by 1.05 and the manifest's sha256 updated to match."""
    art = _copy(tiny_artifact, tmp_path / "skewed")
    model = onnx.load(str(art / MODEL_FILE))
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    gamma = next(i for i in model.graph.initializer if i.name == ln.input[1])
    model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(gamma) * 1.05, "skewed"))
    ln.input[1] = "skewed"
    onnx.save(model, str(art / MODEL_FILE))
    _rewrite_manifest(art, model_sha256=sha256_file(art / MODEL_FILE))
    return art


def test_an_altered_graph_is_refused_under_strict(skewed):
    with start(skewed, "strict") as client:
        r = client.get("/health/ready")
        assert r.status_code == 503 and "golden check failed on CPUExecutionProvider" in r.json()["error"]
        assert "case 'short'" in r.json()["error"]  # which case, by how much
        assert client.post("/v1/encode", json={"embeddings": [[0.1] * 32]}).status_code == 503
        assert 'addnorm_golden_verified{model="encoder"} 0.0' in client.get("/metrics").text


def test_an_altered_graph_is_served_with_a_report_under_warn(skewed, caplog):
    with start(skewed, "warn") as client:
        assert client.get("/health/ready").status_code == 200
        v = client.get("/v1/model").json()["verification"]
        assert v["status"] == "failed" and v["max_abs_err"] > 1e-3
        assert "golden check FAILED" in caplog.text


def test_altered_golden_data_fails_its_own_sha256(tiny_artifact, tmp_path):
    art = _copy(tiny_artifact, tmp_path / "golden")
    golden = load_golden(art / GOLDEN_FILE)
    golden["short"]["oracle.encoded"] = golden["short"]["oracle.encoded"] + 1.0  # would excuse anything
    save_golden(art / GOLDEN_FILE, golden)
    with start(art) as client:
        r = client.get("/health/ready")
        assert r.status_code == 503 and "sha256" in r.json()["error"] and "golden" in r.json()["error"]


def test_an_old_artifact_without_golden_data_serves_with_a_warning(tiny_artifact, tmp_path, caplog):
    art = _copy(tiny_artifact, tmp_path / "old")
    (art / GOLDEN_FILE).unlink()
    _rewrite_manifest(art, golden_sha256=None)
    with start(art) as client:
        assert client.get("/health/ready").status_code == 200
        v = client.get("/v1/model").json()["verification"]
        assert v["status"] == "unverifiable" and "re-export" in v["message"]
        assert "golden check UNVERIFIABLE" in caplog.text
        r = client.post("/v1/encode", json={"embeddings": [[0.1] * 32]})
        assert r.status_code == 200 and np.isfinite(r.json()["encoded"]).all()


def test_off_skips_and_says_so(skewed, caplog):
    with start(skewed, "off") as client:
        assert client.get("/health/ready").status_code == 200
        assert client.get("/v1/model").json()["verification"]["status"] == "skipped"
        assert "golden check SKIPPED" in caplog.text
