"""One trace per graph (export/traces.py): the served graph cut from the debug graph's trace is the graph a trace
without step outputs gives, and the scope never hands one model's trace to another."""

from __future__ import annotations

import collections
import copy

import numpy as np
import onnx
import torch.nn.functional as F

import addnorm.export.onnx_export as onnx_export
from addnorm.export import traces
from addnorm.export.onnx_export import export_onnx, output_names
from addnorm.export.parity import make_session
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import STEP_OUTPUT
from addnorm.model.encoder import build_encoder

# post-norm: the last step is also the final output (the trace copies it with an Identity), pooled: two outputs
CONFIG = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, num_layers=2, pooling="mean")


def _run(path) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, CONFIG.d_model)).astype(np.float32)
    mask = np.zeros((3, 7), bool)
    mask[1, 4:] = True
    return make_session(path).run(None, {"embeddings": x, "mask": mask})


def test_the_served_graph_cut_from_the_debug_trace_is_the_direct_export(tmp_path, monkeypatch):
    encoder = build_encoder(CONFIG, seed=3).eval()
    direct = export_onnx(encoder, tmp_path / "direct.onnx", attention="mha")
    calls = []
    trace = onnx_export._trace
    monkeypatch.setattr(onnx_export, "_trace", lambda *a, **k: calls.append(a[3]) or trace(*a, **k))
    with traces.reusing():
        served = export_onnx(encoder, tmp_path / "served.onnx", attention="mha")
        debug = export_onnx(encoder, tmp_path / "debug.onnx", attention="mha", with_steps=True)
    assert calls == [True]  # one trace, with the step outputs
    assert [o.name for o in served.graph.output] == output_names(encoder, False) == ["encoded", "pooled"]
    assert [o.name for o in debug.graph.output][-1] == STEP_OUTPUT.format(CONFIG.num_norms - 1)
    ops = [collections.Counter(n.op_type for n in m.graph.node) for m in (direct, served)]
    assert ops[0] == ops[1], ops
    assert len(served.graph.initializer) == len(direct.graph.initializer)
    for want, got in zip(_run(tmp_path / "direct.onnx"), _run(tmp_path / "served.onnx"), strict=True):
        np.testing.assert_array_equal(got, want)
    onnx.checker.check_model(served, full_check=True)


def test_a_trace_is_keyed_by_weights_code_dtype_and_form():
    encoder = build_encoder(CONFIG, seed=3).eval()
    key = traces.key(encoder, 17, "mha")
    assert traces.key(copy.deepcopy(encoder), 17, "mha") == key  # the same model, another object
    assert traces.key(encoder, 17, "decomposed") != key
    assert traces.key(copy.deepcopy(encoder).half(), 17, "mha") != key
    skewed = copy.deepcopy(encoder)
    skewed.layers[1].norm2.weight.data[0] += 1e-3
    assert traces.key(skewed, 17, "mha") != key
    patched = copy.deepcopy(encoder)
    for layer in patched.layers:
        layer.activation = lambda x: F.gelu(x, approximate="tanh")
    assert traces.key(patched, 17, "mha") != key


def test_outside_a_scope_nothing_is_kept():
    assert traces.cache() is None
    with traces.reusing():
        outer = traces.cache()
        with traces.reusing():
            assert traces.cache() is outer  # nested scopes share the outermost one
    assert traces.cache() is None


def test_the_gates_torch_side_is_computed_once_per_model_and_input_in_a_scope(tmp_path, monkeypatch):
    """torch fp32, the float64 oracles and float32's spread depend on the model and the input, never on the graph:
    a second gate of the same model in a scope computes none of them again and judges alike; another model's
    weights are never answered from the first one's."""
    import addnorm.export.parity as parity
    from addnorm.export.cases import default_cases

    encoder = build_encoder(CONFIG, seed=3).eval()
    path = tmp_path / "m.onnx"
    export_onnx(encoder, path, attention="mha")
    calls = collections.Counter()
    for name in ("torch_outputs", "float32_spread"):
        real = getattr(parity, name)
        monkeypatch.setattr(parity, name, lambda *a, _f=real, _n=name: calls.update([_n]) or _f(*a))
    cases = default_cases()[:3]
    with traces.reusing():
        first = parity.run_parity(encoder, make_session(path), cases)
        once = dict(calls)
        again = parity.run_parity(copy.deepcopy(encoder), make_session(path), cases)
        assert dict(calls) == once and once["torch_outputs"] == 2 * len(cases)  # torch fp32 and float64, once
        assert again.summary() == first.summary()
        skewed = copy.deepcopy(encoder)
        skewed.layers[1].norm2.weight.data *= 1.05
        refused = parity.run_parity(skewed, make_session(path), cases)
    assert calls["torch_outputs"] == 4 * len(cases) and not refused.passed and first.passed
    with traces.reusing():
        (kept,) = traces.remembered("k", lambda: {"a": np.zeros(2)}).values()
    assert not kept.flags.writeable  # a remembered array cannot be changed by one of its readers


def test_torch_onnx_exports_registry_is_built_once_a_process_and_changes_no_graph(tmp_path, monkeypatch):
    """export_module builds torch.onnx.export's registry of torchlib functions once per opset (the exporter parses
    ~500 functions' source for it on every call): two exports read torchlib once, a graph exported on the kept
    registry is the graph a fresh one gives, and one export's custom translations never reach the next."""
    from torch.onnx._internal.exporter import _registration

    original = _registration.ONNXRegistry.from_torchlib
    reads = []
    torchlib = _registration.onnxscript_apis.get_torchlib_ops
    monkeypatch.setattr(
        _registration.onnxscript_apis, "get_torchlib_ops", lambda: reads.append(1) or torchlib()
    )
    monkeypatch.setattr(onnx_export, "_TORCHLIB", {})
    encoder = build_encoder(CONFIG, seed=3).eval()
    fresh = export_onnx(encoder, tmp_path / "fresh.onnx", attention="onnx", opset=23)  # custom translations
    kept = export_onnx(encoder, tmp_path / "kept.onnx", attention="onnx", opset=23)
    other = export_onnx(build_encoder(CONFIG, seed=4).eval(), tmp_path / "other.onnx", attention="mha")
    assert len(reads) == len(onnx_export._TORCHLIB) == 2  # once per opset (torch builds 18's for 17)
    assert kept.SerializeToString() == fresh.SerializeToString()
    assert other.graph.node  # the registry's kept lists served a second model and opset
    for built in onnx_export._TORCHLIB.values():
        assert not any(d.is_custom for decomps in built.functions.values() for d in decomps)
    assert _registration.ONNXRegistry.from_torchlib == original  # torch's own again after each export
