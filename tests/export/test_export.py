"""Export: graph rules, parity gate, CLI, checkpoints from PyTorch's own layers."""

import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from addnorm.export import cli
from addnorm.export.cases import Case, default_cases
from addnorm.export.checks import GraphCheckError, check_graph, op_counts
from addnorm.export.gate import ParityError
from addnorm.export.onnx_export import ExportError, export_onnx
from addnorm.export.parity import Tolerance, make_session, run_parity
from addnorm.export.pipeline import export_artifact
from addnorm.export.report import format_table
from addnorm.export.weights import CheckpointError, load_weights
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import Encoder, build_encoder
from tests.conftest import TINY


def test_tiny_graph_has_native_layer_norms_and_symbolic_dims(tiny_artifact):
    model = onnx.load(str(tiny_artifact / "model.onnx"))
    counts = op_counts(model)
    assert counts["LayerNormalization"] == 2
    assert counts["ReduceMean"] == 0
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims[:2]] == ["batch", "seq"] and dims[2].dim_value == TINY.d_model
    assert not list(tiny_artifact.glob("*.data"))  # self-contained: no external data file


def test_renamed_artifact_still_loads(tiny_artifact, tmp_path):
    moved = tmp_path / "renamed.onnx"
    moved.write_bytes((tiny_artifact / "model.onnx").read_bytes())
    sess = make_session(moved)
    out = sess.run(
        None, {"embeddings": np.zeros((1, 3, TINY.d_model), np.float32), "mask": np.zeros((1, 3), bool)}
    )
    assert out[0].shape == (1, 3, TINY.d_model)


@pytest.mark.parametrize(("num_layers", "norm_first", "expected"), [(2, False, 4), (2, True, 5)])
def test_layer_norm_count_follows_depth_and_placement(tmp_path, num_layers, norm_first, expected):
    cfg = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, num_layers=num_layers, norm_first=norm_first)
    model = export_onnx(build_encoder(cfg), tmp_path / "m.onnx")
    assert check_graph(model, cfg)["norm_nodes"] == expected


def test_graph_check_catches_a_wrong_norm_count(tiny_artifact):
    model = onnx.load(str(tiny_artifact / "model.onnx"))
    with pytest.raises(GraphCheckError, match="expected 4 LayerNormalization"):
        check_graph(model, EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, num_layers=2))


def test_graph_check_catches_a_decomposed_layer_norm(tmp_path):
    class Decomposed(Encoder):  # LayerNorm spelled out: mean, var, sqrt
        def forward(self, embeddings, mask=None, steps=None):
            mu = embeddings.mean(-1, keepdim=True)
            return (embeddings - mu) / ((embeddings - mu).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()

    cfg = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64)
    model = export_onnx(Decomposed(cfg).eval(), tmp_path / "m.onnx", opset=18)
    # the ReduceMean rule's own message: the node count rule would refuse this graph too, for another reason
    with pytest.raises(
        GraphCheckError, match=r"decomposed normalization \(.*ReduceMean.*\); expected native"
    ):
        check_graph(model, cfg)


def test_opset_below_17_is_refused(tmp_path):
    with pytest.raises(ExportError, match="LayerNormalization"):
        export_onnx(build_encoder(TINY), tmp_path / "m.onnx", opset=16)


def test_default_cases_avoid_the_export_example_sizes():
    cases = default_cases()
    assert len(cases) >= 20
    assert all((c.batch, c.seq) != (2, 5) for c in cases)
    assert any(c.seq == 1 for c in cases) and max(c.seq for c in cases) >= 512
    assert any(c.pad for c in cases) and any(not c.pad for c in cases)


def test_parity_fails_and_names_the_worst_element_for_other_weights(tiny_artifact):
    other = build_encoder(TINY, seed=99)  # not the weights the graph was exported from
    report = run_parity(other, make_session(tiny_artifact / "model.onnx"), [Case("b2 s3", 2, 3)])
    assert not report.passed
    assert "worst element" in format_table(report) and "index" in format_table(report)


def test_failed_parity_writes_no_manifest(tmp_path, monkeypatch):
    from addnorm.export import gate

    def broken_parity(encoder, session, *a, **kw):  # the torch side drifts: a graph that no longer matches
        return run_parity(build_encoder(encoder.config, seed=42), session, [Case("b1 s4", 1, 4)])

    monkeypatch.setattr(gate, "run_parity", broken_parity)
    with pytest.raises(ParityError, match="worst element"):
        export_artifact(build_encoder(TINY), tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob(".staging-*"))


def test_oracle_rescues_only_when_onnx_is_as_close_to_float64_as_torch():
    from addnorm.export.parity import compare

    oracle = np.array([1.0, 2.0])
    torch_out = oracle + 1e-3  # torch fp32 itself is off by 1e-3 on this input
    onnx_close = oracle + 2e-3  # beyond atol vs torch, but within 4x of torch's own error
    onnx_far = oracle + 5e-2
    tol = Tolerance()
    assert compare("y", onnx_close, torch_out, oracle, tol).passed
    assert not compare("y", onnx_close, torch_out, oracle, tol).within_tolerance
    assert not compare("y", onnx_far, torch_out, oracle, tol).passed
    assert not compare("y", np.array([np.nan, 2.0]), torch_out, oracle, tol).passed


def test_cli_exports_with_flags_and_prints_json(tmp_path, capsys):
    rc = cli.main(
        [
            "--artifact",
            str(tmp_path / "a"),
            "--d-model",
            "32",
            "--nhead",
            "4",
            "--dim-feedforward",
            "64",
            "--norm-first",
            "--activation",
            "gelu",
            "--json",
            "-q",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)  # the full report, as addnorm-parity --json prints it
    summary = report["summary"]
    assert summary["passed"] and summary["cases"] >= 20 and summary["max_abs_err"] <= 1e-5
    assert len(report["cases"]) == summary["cases"]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["config"]["norm_first"] is True and manifest["config"]["activation"] == "gelu"


def test_cli_config_file_and_bad_config(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps({"d_model": 30, "nhead": 4}))
    assert cli.main(["--artifact", str(tmp_path / "a"), "--config", str(tmp_path / "c.json")]) == 2
    assert "divisible by nhead" in capsys.readouterr().err
    assert not (tmp_path / "a" / "manifest.json").exists()


def _torch_layer(norm_first: bool = False) -> nn.TransformerEncoderLayer:
    torch.manual_seed(5)
    return nn.TransformerEncoderLayer(32, 4, 64, norm_first=norm_first, batch_first=True).eval()


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_checkpoint_from_torch_layer_loads_unchanged(tmp_path, fmt):
    layer = _torch_layer()
    path = tmp_path / f"w.{fmt}"
    if fmt == "pt":
        torch.save(layer.state_dict(), path)
    else:
        save_file({k: v.contiguous() for k, v in layer.state_dict().items()}, str(path))
    enc = load_weights(Encoder(TINY), path)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(enc(x), layer(x), atol=1e-6, rtol=0)


def test_checkpoint_with_wrong_keys_or_shapes_is_named(tmp_path):
    layer = _torch_layer()
    state = layer.state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["norm2.bias"]
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \['layers.0.norm2.bias'\].*unexpected keys"):
        load_weights(Encoder(TINY), tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="shape mismatches"):
        load_weights(Encoder(EncoderConfig(d_model=32, nhead=4, dim_feedforward=128)), tmp_path / "bad.pt")


def test_checkpoint_that_needs_unpickling_is_refused(tmp_path):
    torch.save({"w": torch.zeros(1), "code": object()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="would run code from the file; save model.state_dict") as exc:
        load_weights(Encoder(TINY), tmp_path / "evil.pt")
    assert "\n" not in str(exc.value) and "weights_only=False" not in str(
        exc.value
    )  # torch's 6 lines, not ours
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(CheckpointError, match="neither a safetensors file nor a torch.save archive") as exc:
        load_weights(Encoder(TINY), tmp_path / "text.pt")
    assert "\n" not in str(exc.value)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_weights(Encoder(TINY), tmp_path / "junk.safetensors")


def test_parity_cli_rechecks_an_artifact(tiny_artifact, capsys):
    from addnorm.export import parity_cli

    assert parity_cli.main(["--artifact", str(tiny_artifact), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["passed"] and len(report["cases"]) >= 20


def test_the_gate_runs_two_float64_oracles_and_fails_when_they_disagree(tiny_artifact, monkeypatch):
    """torch float64 and the numpy reference (model/reference.py, no shared code) run every case: they agree to
    rounding, and a disagreement (one oracle wrong) fails the case even where onnxruntime matches torch."""
    from addnorm.export import parity

    session = make_session(tiny_artifact / "model.onnx")
    cases = [Case("b2 s3", 2, 3), Case("b2 s6 padded", 2, 6, pad=0.5, all_pad_row=True)]
    report = run_parity(build_encoder(TINY), session, cases)
    assert report.passed and report.summary()["max_oracles_gap"] < 1e-12
    assert "float64 oracles (torch, numpy) agree to" in format_table(report)
    real = parity.reference.forward
    monkeypatch.setattr(parity.reference, "forward", lambda *a, **k: real(*a, **k) + 1e-6)
    report = run_parity(build_encoder(TINY), session, cases)
    assert not report.passed and all(c.passed for r in report.results for c in r.comparisons)
