"""Attention as one operator (export/attention.py): each form's graph check and parity, all-padding rows included."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from addnorm.export import cli, parity_cli, traces
from addnorm.export.attention import AUTO, GELUS, resolve, spelled
from addnorm.export.checks import GraphCheckError, check_graph, op_counts
from addnorm.export.onnx_export import ExportError, export_onnx
from addnorm.model import attention as held
from addnorm.model.attention import held_form, score_elements
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import build_encoder
from addnorm.model.runtime import CPU, session_args
from tests.text_models import MODERN

SMALL = ["--d-model", "64", "--nhead", "4", "--dim-feedforward", "128"]
CFG = EncoderConfig(d_model=64, nhead=4, dim_feedforward=128, num_layers=2, dropout=0.0)


def export(out, *flags) -> dict:
    assert cli.main(["--artifact", str(out), *SMALL, *flags, "-q"]) == 0
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize(
    ("flags", "form", "ops"),
    [
        ([], "mha", {"If": 1, "MultiHeadAttention": 2, "Softmax": 0}),  # the default
        (["--attention", "mha", "--opset", "23"], "mha", {"If": 1, "MultiHeadAttention": 2}),
        (["--attention", "onnx", "--opset", "23"], "onnx", {"Attention": 1, "Softmax": 0}),
        (["--attention", "decomposed"], "decomposed", {"Softmax": 1, "MultiHeadAttention": 0}),
        (
            ["--attention", "mha", "--norm-first", "--activation", "gelu"],
            "mha",
            {"MultiHeadAttention": 2, "Gelu": 1},
        ),
        # the exact GELU as onnxruntime's one operator in the mha form only; the standard spelling elsewhere
        (["--attention", "decomposed", "--activation", "gelu"], "decomposed", {"Gelu": 0, "Erf": 1}),
    ],
)  # each form under every variant: tests/export/test_matrix.py counts its nodes and runs the adversarial suite
@traces.reusing()  # addnorm-parity's debug graph below: the export's own trace (export/traces.py)
def test_each_form_exports_counts_its_nodes_and_passes_the_adversarial_gate(tmp_path, flags, form, ops):
    manifest = export(tmp_path / "a", *flags)
    assert manifest["attention"] == form and manifest["parity"]["passed"]
    counts = op_counts(onnx.load(str(tmp_path / "a" / "model.onnx")))
    assert {op: counts[op] for op in ops} == ops
    # addnorm-parity rebuilds the debug graph in the manifest's form; the adversarial suite holds a row whose
    # keys are all padding, heavy padding, and extreme offsets
    report = parity_cli.check_artifact(tmp_path / "a", adversarial=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize("form", ["mha", "onnx", "decomposed"])
def test_rows_whose_keys_are_all_padding_are_finite_and_equal_the_reference(tmp_path, form):
    """The reference gives such rows uniform weights over the keys (never -inf -> NaN); every form matches."""
    encoder = build_encoder(CFG)
    opset = 23 if form == "onnx" else 17
    export_onnx(encoder, tmp_path / "m.onnx", opset, attention=form)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0] = True  # every key of row 0 is padding
    mask[1, 4:] = True
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"embeddings": x.numpy(), "mask": mask.numpy()})[0]
    with torch.no_grad():
        want = encoder(x, mask).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # and without any padding (mha's flash branch)
    got = sess.run(None, {"embeddings": x.numpy(), "mask": np.zeros((3, 7), bool)})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, encoder(x).numpy(), atol=1e-5, rtol=0)


LOCAL = EncoderConfig(**MODERN)  # ModernBERT's block: local layers with a window of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_local_layer_is_banded_past_its_threshold_and_equals_the_reference(tmp_path, monkeypatch, dtype):
    """Past BANDED_FROM positions a local layer's window runs in blocks (export/attention.py); below, one masked
    MultiHeadAttention: both equal the reference on every row, padding rows too (a query far from any real key gets
    the reference's uniform weights), at lengths on and off the block size (4) and on both sides of the threshold
    (8 here; the graph holds it as traced)."""
    monkeypatch.setattr(held, "BANDED_FROM", 8)
    encoder = build_encoder(LOCAL).to(dtype).eval()
    export_onnx(encoder, tmp_path / "m.onnx", attention="mha")
    counts = op_counts(onnx.load(str(tmp_path / "m.onnx")))
    assert (counts["If"], counts["Softmax"]) == (
        3,
        2,
    )  # the global layer's padding If, each local layer's length If
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    rng = torch.Generator().manual_seed(1)
    for seq in (7, 8, 9, 16, 23):
        x = torch.randn(4, seq, 32, generator=rng)
        mask = torch.zeros(4, seq, dtype=torch.bool)
        mask[1, 3:] = True  # one real token, and queries more than a window away from it
        mask[2, seq - 2 :] = True
        mask[3] = True  # no real key at all
        with torch.no_grad():
            want = encoder(x.to(dtype), mask).float().numpy()
        got = sess.run(None, {"embeddings": x.numpy(), "mask": mask.numpy()})[0]
        assert np.isfinite(got).all()
        # one MultiHeadAttention weighs a query with no real key in its window over that window, not every key;
        # the banded form keeps the reference's uniform weights: all rows compared past the threshold
        rows = ~mask.numpy() if seq <= held.BANDED_FROM else np.ones(mask.shape, bool)
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        np.testing.assert_allclose(got[rows], want[rows], atol=atol, rtol=0, err_msg=f"{seq} positions")


def test_spelled_swaps_the_kernel_only_inside_the_block_and_keeps_eager_results():
    encoder = build_encoder(CFG)
    x = torch.randn(2, 5, 64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        want = encoder(x, mask)
        with spelled(encoder, "mha"):
            assert encoder.layers[0].self_attn.attend.__name__ == "_attend_mha"
            torch.testing.assert_close(encoder(x, mask), want, rtol=0, atol=1e-6)
    assert encoder.layers[0].self_attn.attend.__name__ == "attend"


def test_spelled_gives_the_mha_forms_feed_forward_onnxruntimes_gelu_and_keeps_eager_results():
    encoder = build_encoder(dataclasses.replace(CFG, activation="gelu"))
    x = torch.randn(2, 5, 64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        want = encoder(x, mask)
        for form, inside in (("mha", GELUS["mha"]), ("decomposed", F.gelu)):
            with spelled(encoder, form):
                assert all(layer.activation is inside for layer in encoder.layers)
                torch.testing.assert_close(encoder(x, mask), want, rtol=0, atol=1e-6)
    assert all(layer.activation is F.gelu for layer in encoder.layers)
    relu = build_encoder(CFG)  # a ReLU feed-forward is left as it is
    with spelled(relu, "mha"):
        assert all(layer.activation is F.relu for layer in relu.layers)


def test_onnxruntime_fuses_the_mha_forms_gelu_with_its_bias(tmp_path):
    """Why the mha form spells the GELU as one operator: onnxruntime 1.32 leaves the exporter's five (Div, Erf, Add,
    Mul, Mul) as they are, and fuses com.microsoft.Gelu with the bias add before it into one BiasGelu (5-8% of a
    small batch's run: docs/benchmarks.md, "GELU as one operator"). A session made as the server makes it."""
    cfg = dataclasses.replace(CFG, activation="gelu")
    fused = {}
    for form in ("mha", "decomposed"):
        export_onnx(build_encoder(cfg), tmp_path / f"{form}.onnx", attention=form)
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / f"{form}.optimized.onnx")
        ort.InferenceSession(str(tmp_path / f"{form}.onnx"), opts, **session_args([CPU]))
        fused[form] = op_counts(onnx.load(opts.optimized_model_filepath))
    assert fused["mha"]["BiasGelu"] == cfg.num_layers and fused["mha"]["Erf"] == 0
    assert fused["decomposed"]["BiasGelu"] == 0 and fused["decomposed"]["Erf"] == cfg.num_layers


def test_mha_runs_eagerly_without_torch_cond_and_traces_one(monkeypatch, tmp_path):
    """Eager (the gate's torch side): one branch in Python, never torch.cond, which compiles both branches with
    dynamo on every new shape and dtype (2 s the first time); traced: the If the graph is counted for above."""
    encoder = build_encoder(CFG)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad(), spelled(encoder.double(), "mha"):
        want = [encoder(x, m) for m in (mask, torch.zeros_like(mask))]
        calls: list[str] = []
        real_cond = torch.cond
        monkeypatch.setattr(torch, "cond", lambda *a, **k: calls.append("cond") or real_cond(*a, **k))
        got = [encoder(x, m) for m in (mask, torch.zeros_like(mask))]
    assert calls == [] and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    export_onnx(build_encoder(CFG), tmp_path / "m.onnx", attention="mha")
    assert calls and op_counts(onnx.load(str(tmp_path / "m.onnx")))["If"] == CFG.num_layers


def test_choices_resolve_and_refuse_what_cannot_be_exported(tmp_path):
    assert resolve("auto", 17) == AUTO == "mha"
    assert resolve("decomposed", 17) == "decomposed"
    with pytest.raises(ExportError, match="needs opset 23"):
        export_onnx(build_encoder(CFG), tmp_path / "m.onnx", 17, attention="onnx")
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        resolve("flash", 17)
    assert cli.main(["--artifact", str(tmp_path / "x"), *SMALL, "--attention", "onnx", "-q"]) == 2


def test_graph_check_names_a_graph_that_lacks_its_attention_nodes(tmp_path):
    model = export_onnx(build_encoder(CFG), tmp_path / "m.onnx", 17, attention="decomposed")
    with pytest.raises(GraphCheckError, match=r"mha attention: expected 2 If node\(s\), found 0"):
        check_graph(model, CFG, "fp32", "mha")
    assert check_graph(model, CFG, "fp32", "decomposed")["attention_nodes"] == 2


def test_working_set_by_form():
    assert score_elements("mha", 2, 12, 100, padded=False) == 0  # flash attention: no seq x seq tensor
    assert score_elements("mha", 2, 12, 100, padded=True) == 2 * 12 * 100 * 100
    assert score_elements("onnx", 1, 12, 100, padded=False) == 12 * 100 * 100
    assert score_elements("decomposed", 1, 12, 100, padded=False) == 3 * 12 * 100 * 100
    # local layers (ModernBERT): one masked MultiHeadAttention up to BANDED_FROM positions, banded past it
    assert held_form("mha", relative=False, windowed=True) == "mha-windowed"
    assert held_form("mha", relative=True, windowed=False) == "mha-biased"
    assert held_form("decomposed", relative=False, windowed=True) == "decomposed"
    long = held.BANDED_FROM + 1
    assert score_elements("mha-windowed", 1, 12, long, padded=False) == 0
    assert score_elements("mha-windowed", 1, 12, long, padded=True) == 12 * long * long
    assert score_elements("mha-windowed", 2, 12, 100, padded=False) == 2 * 12 * 100 * 100
    assert score_elements("mha-biased", 1, 12, long, padded=False) == 12 * long * long
