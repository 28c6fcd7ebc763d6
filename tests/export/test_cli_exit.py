"""The two gate commands, run as commands: exit 1 on a parity failure, naming the worst element."""

import re
import shutil
import subprocess
import sys

import pytest

from addnorm.export.weights import save_weights
from addnorm.model.encoder import build_encoder
from tests.conftest import ROOT, TINY

# addnorm-export with a fault injected: the fp32 builder scales the first LayerNorm's gamma by 1.05 (a graph that
# no longer computes what torch does). Everything else is the real command.
SKEWED_EXPORT = """
import dataclasses, sys
import onnx
from onnx import numpy_helper
import addnorm.export.variants as v

real = v.VARIANTS["fp32"].build

def skewed(encoder, path, opset, with_steps, attention):
    model = real(encoder, path, opset, with_steps, attention)
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    gamma = next(i for i in model.graph.initializer if i.name == ln.input[1])
    model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(gamma) * 1.05, "skewed"))
    ln.input[1] = "skewed"
    onnx.save(model, str(path))
    return model

v.VARIANTS["fp32"] = dataclasses.replace(v.VARIANTS["fp32"], build=skewed)
from addnorm.export.cli import main
sys.exit(main(sys.argv[1:]))
"""
# the exports in this process repeat one tiny block: one trace (the faulty export runs in its own process)
pytestmark = pytest.mark.usefixtures("one_trace_per_model")
TINY_FLAGS = ["--d-model", "32", "--nhead", "4", "--dim-feedforward", "64", "--dropout", "0"]


def test_addnorm_export_exits_1_on_a_parity_failure_and_writes_no_manifest(tmp_path):
    cmd = [sys.executable, "-c", SKEWED_EXPORT, "--artifact", str(tmp_path / "a"), *TINY_FLAGS]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "FAILED" in r.stderr and "error: parity failed" in r.stderr and "worst element" in r.stderr
    assert re.search(r"add_norm_0 .*FAIL", r.stderr)  # the per-step table names the skewed sublayer
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_addnorm_parity_exits_1_when_the_weights_do_not_match_the_graph(tiny_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    save_weights(build_encoder(TINY, seed=7), art / "weights.safetensors")  # not the graph's weights
    r = subprocess.run(
        [sys.executable, "-m", "addnorm.export.parity_cli", "--artifact", str(art), "--no-steps"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout and "worst element" in r.stdout
    ok = subprocess.run(
        [sys.executable, "-m", "addnorm.export.parity_cli", "--artifact", str(tiny_artifact), "--no-steps"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0 and "PASSED: 20 of 20 cases within the tolerance of torch fp32" in ok.stdout
    assert "x its allowance (above 1 fails)" in ok.stdout


def test_if_missing_keeps_a_valid_artifact_and_replaces_a_broken_one(tiny_artifact, tmp_path, capsys):
    """What the Dockerfile, compose's export service and the k8s export job rely on: a valid artifact is left as it
    is (not one byte written), a tampered or absent one is exported anew."""
    from addnorm.export import cli
    from addnorm.model.artifact import Manifest, load_verified, sha256_file

    flags = ["--d-model", "32", "--nhead", "4", "--dim-feedforward", "64", "--if-missing", "-q"]
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    before = {p.name: p.stat().st_mtime_ns for p in art.iterdir()}
    assert cli.main(["--artifact", str(art), *flags[:-1]]) == 0
    assert "already holds a valid artifact; nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in art.iterdir()} == before

    (art / "model.onnx").write_bytes((art / "model.onnx").read_bytes() + b"\0")  # tampered: no longer valid
    assert cli.main(["--artifact", str(art), *flags]) == 0
    load_verified(art)  # a valid artifact again, its manifest describing the new graph
    assert Manifest.load(art).model_sha256 == sha256_file(art / "model.onnx")

    fresh = tmp_path / "fresh"  # absent
    assert cli.main(["--artifact", str(fresh), *flags]) == 0
    load_verified(fresh)
