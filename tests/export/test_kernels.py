"""int8's kernels (model/kernels) against the ONNX functions they stand in for (export/int8_ops.py): on every
instruction set this CPU has (each in its own process: the library picks one when it loads), the same answers as
each other bit for bit, and the functions' up to the float side's order of summation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from addnorm.export import int8_ops
from addnorm.model import kernels
from addnorm.model.runtime import cpu_flags
from addnorm.model.schemes import DEFAULT_FORM
from tests.conftest import ROOT

FLAGS = cpu_flags()
# every path this CPU can take: AVX2 always (the library's floor), VNNI and AMX where present
ISAS = ["avx2"] + ["vnni"] * ("avx512_vnni" in FLAGS) + ["amx"] * ("amx_int8" in FLAGS)
# (rows, K, N): AMX blocks of 32 rows and a rest; K off AMX's 64; N with a tail past its 16s; K off 4 (plain C++);
# no rows at all; the widest product of all-MiniLM-L6-v2
PRODUCTS = [(70, 64, 96), (37, 40, 24), (5, 6, 16), (0, 64, 32), (33, 384, 1536)]
ROWS = [(33, 64, 4), (9, 40, 2), (70, 1536, 8)]  # (rows, E, float channels)


def _model(node: onnx.NodeProto, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, outputs, inits)
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=imports, functions=int8_ops.functions(17))


def _value(name: str, dtype: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, None)


def product_case(rows: int, k: int, n: int, seed: int = 0):
    """A QuantMatMul node's model and feed: pair-bounded 8-bit weights (the scheme's: exact on VPMADDUBSW)."""
    rng = np.random.default_rng(seed)
    wq, w_scale = DEFAULT_FORM.quantize(rng.standard_normal((k, n)))
    j = 5
    feed = {
        "q": rng.integers(0, 256, (rows, k), dtype=np.uint8),
        "step": rng.uniform(0.01, 0.1, (rows, 1)).astype(np.float32),
        "side": rng.standard_normal((rows, j)).astype(np.float32),
    }
    inits = [
        numpy_helper.from_array(wq.astype(np.int8), "w"),
        numpy_helper.from_array(w_scale.astype(np.float32), "w_scale"),
        numpy_helper.from_array(rng.standard_normal((j, n)).astype(np.float32), "side_w"),
    ]
    inputs = [
        _value("q", TensorProto.UINT8),
        _value("step", TensorProto.FLOAT),
        _value("side", TensorProto.FLOAT),
    ]
    node = helper.make_node(
        int8_ops.QUANT_MATMUL, [*feed, "w", "w_scale", "side_w"], ["y"], domain=kernels.DOMAIN
    )
    return _model(node, inputs, [_value("y", TensorProto.FLOAT)], inits), feed


def rows_case(rows: int, width: int, floats: int, seed: int = 0):
    """A RowQuantize node's model and feed: rows with an offset, their float channels 20x the rest."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(width, floats, replace=False)
    x = rng.standard_normal((rows, width)).astype(np.float32) + rng.uniform(-3, 3, (rows, 1)).astype(
        np.float32
    )
    x[:, idx] *= 20
    keep = np.ones(width, np.float32)
    keep[idx] = 0
    pick = np.zeros((width, floats + 1), np.float32)
    pick[idx, np.arange(floats)] = 1
    pick[:, -1] = keep / keep.sum()
    inits = [numpy_helper.from_array(pick, "pick"), numpy_helper.from_array(keep, "keep")]
    node = helper.make_node(
        int8_ops.ROW_QUANTIZE, ["x", "pick", "keep"], ["q", "step", "s"], domain=kernels.DOMAIN
    )
    outputs = [
        _value("q", TensorProto.UINT8),
        _value("step", TensorProto.FLOAT),
        _value("s", TensorProto.FLOAT),
    ]
    return _model(node, [_value("x", TensorProto.FLOAT)], outputs, inits), {"x": x}


def run(model: onnx.ModelProto, feed: dict, library=None) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, feed
    )


def all_cases() -> list[tuple[onnx.ModelProto, dict]]:
    return [product_case(*c) for c in PRODUCTS] + [rows_case(*c) for c in ROWS]


_CHILD = """
import json, sys, numpy as np
from tests.export.test_kernels import all_cases, run
from addnorm.model import kernels
out = {}
for i, (model, feed) in enumerate(all_cases()):
    for j, y in enumerate(run(model, feed, kernels.library_path())):
        out[f"{i}.{j}"] = y
np.savez(sys.argv[1], **out)
"""


@pytest.fixture(scope="module")
def by_isa(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """Every case's kernel answers, per instruction set (a process each, ADDNORM_KERNELS_ISA capping it)."""
    assert kernels.library_path().is_file(), "the kernel library is not built (tests/conftest.py builds it)"
    found = {}
    for isa in ISAS:
        path = tmp_path_factory.mktemp(isa) / "out.npz"
        env = {**os.environ, "ADDNORM_KERNELS_ISA": isa, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True, env=env, cwd=ROOT, timeout=300)
        found[isa] = dict(np.load(path))
    return found


def test_every_instruction_set_gives_the_same_bits(by_isa):
    first, *others = ISAS
    for isa in others:
        for key, y in by_isa[first].items():
            np.testing.assert_array_equal(by_isa[isa][key], y, err_msg=f"{isa} against {first}, output {key}")


def test_the_kernels_compute_the_functions(by_isa):
    """QuantMatMul: the functions' answers up to float rounding (its integer products exact); RowQuantize: the same
    levels but where the row's mean, summed in another order, moves one across a rounding boundary."""
    got = by_isa[ISAS[-1]]
    for i, (model, feed) in enumerate(all_cases()):
        want = run(model, feed)  # no library: onnxruntime inlines the function bodies
        if i < len(PRODUCTS):
            y = got[f"{i}.0"]
            assert y.shape == want[0].shape
            np.testing.assert_allclose(
                y, want[0], rtol=0, atol=1e-6 * max(1.0, float(np.abs(want[0]).max(initial=0)))
            )
            continue
        q, step, side = (got[f"{i}.{j}"] for j in range(3))
        moved = q.astype(int) - want[0]
        assert np.abs(moved).max() <= 1 and (moved != 0).mean() < 1e-3, (
            np.abs(moved).max(),
            (moved != 0).mean(),
        )
        np.testing.assert_allclose(step, want[1], rtol=1e-5)
        np.testing.assert_allclose(side, want[2], rtol=1e-5, atol=1e-5 * float(np.abs(want[2]).max()))


def test_onnxruntime_runs_the_kernels_only_where_the_library_is_registered(tmp_path):
    """By the profile: QuantMatMul and RowQuantize as kernels with the library; without, their bodies inlined."""
    model, feed = product_case(64, 64, 64)

    def ops(library) -> set[str]:
        opts = ort.SessionOptions()
        opts.enable_profiling = True
        opts.profile_file_prefix = str(tmp_path / f"p{library is not None}")
        kernels.register(opts, "CPUExecutionProvider", str(library) if library else "off")
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        session.run(None, feed)
        with open(session.end_profiling()) as f:
            return {
                e["args"]["op_name"]
                for e in json.load(f)
                if e.get("cat") == "Node" and "op_name" in e["args"]
            }

    library = kernels.library_path()
    assert "QuantMatMul" in ops(library) and "MatMulInteger" not in ops(library)
    assert "QuantMatMul" not in ops(None) and {"MatMulInteger", "MatMulIntegerToFloat"} & ops(None)


def test_the_library_is_registered_on_the_cpu_provider_only():
    library = str(kernels.library_path())
    assert kernels.register(ort.SessionOptions(), "CUDAExecutionProvider", library) is None
    assert kernels.register(ort.SessionOptions(), "CPUExecutionProvider", "off") is None
    assert kernels.register(ort.SessionOptions(), "CPUExecutionProvider", library) == kernels.library_path()
    assert kernels.register(ort.SessionOptions(), "CPUExecutionProvider") == kernels.find()
    with pytest.raises(kernels.KernelError, match="does not exist"):
        kernels.find("/nonexistent/libaddnorm_kernels.so")


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    return str(path)


def test_auto_picks_the_kernels_on_every_cpu_that_can_run_them(tmp_path):
    """auto: on every CPU with AVX2 and FMA (measured faster than the standard operators with AMX, AVX-512 VNNI and
    AVX2 only: docs/parity.md); never on a CPU without them, where a path is an error."""
    library = kernels.library_path()
    assert kernels.find("auto", _cpuinfo(tmp_path, "fma avx2 avx512f avx512bw avx512_vnni")) == library
    assert kernels.find("auto", _cpuinfo(tmp_path, "fma avx avx2")) == library
    assert kernels.find("off", _cpuinfo(tmp_path, "fma avx avx2")) is None
    assert kernels.find(str(library), _cpuinfo(tmp_path, "fma avx avx2")) == library
    assert kernels.find("auto", _cpuinfo(tmp_path, "sse4_2 avx2")) is None
    with pytest.raises(kernels.KernelError, match="needs a CPU with fma"):
        kernels.find(str(library), _cpuinfo(tmp_path, "sse4_2 avx2"))
    assert kernels.isa(library) == (
        "amx" if "amx_int8" in FLAGS else "vnni" if "avx512_vnni" in FLAGS else "avx2"
    )


def test_an_engine_serves_int8_on_the_kernels_verified_and_answering_as_without(tmp_path):
    """The server's engine with the library (its golden check passing on it) and without: the same answers within
    the float side's rounding; a library path that is not there stops the engine with the reason; an fp32 graph
    runs without it."""
    from addnorm.service.backend.engine import Engine, EngineError, verify_engine
    from tests.conftest import SMALL, export_to

    artifact = export_to(tmp_path / "a", SMALL, variant="int8")
    fast = Engine(artifact, "cpu", 1, kernels_setting=str(kernels.library_path()))
    plain = Engine(artifact, "cpu", 1, kernels_setting="off")
    assert fast.kernels == kernels.library_path() and plain.kernels is None
    assert verify_engine(fast, "strict").status == "passed"
    x = np.random.default_rng(3).standard_normal((3, 17, SMALL.d_model)).astype(np.float32)
    got, want = fast.run(x)["encoded"], plain.run(x)["encoded"]
    assert 0 < np.abs(got - want).max() < 1e-3 * np.abs(want).max()  # the kernels ran, and agree
    with pytest.raises(EngineError, match="does not exist"):
        Engine(artifact, "cpu", 1, kernels_setting=str(tmp_path / "missing.so"))
    # a graph without int8's operators gets no library (and its load line names none)
    fp32 = export_to(tmp_path / "b", SMALL)
    assert Engine(fp32, "cpu", 1, kernels_setting=str(kernels.library_path())).kernels is None


def test_a_library_of_another_source_is_never_found(tmp_path, monkeypatch):
    """The file name carries the source's digest: an edited int8.cc is not served by a stale build."""
    source = tmp_path / "int8.cc"
    source.write_text(kernels.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(kernels, "SOURCE", source)
    assert kernels.library_path().parent == tmp_path and kernels.find() is None


def test_an_int8_graph_calls_one_row_quantize_per_activation_and_one_product_per_weight(tmp_path):
    """export/int8.py on a one-layer graph: a RowQuantize per quantized activation (4: q, k and v share theirs), its
    float channels those the plan chose; a QuantMatMul per weight product (6); the two functions' bodies in the
    model, in standard operators; every node's inputs made by the graph."""
    from addnorm.export.calibration import calibration_cases
    from addnorm.export.pipeline import plan_for
    from addnorm.export.variants import build_graph
    from addnorm.model.config import EncoderConfig
    from addnorm.model.encoder import build_encoder
    from addnorm.model.schemes import FLOAT_CHANNELS_KEY

    encoder = build_encoder(EncoderConfig(d_model=64, nhead=4, dim_feedforward=128))
    x = np.random.default_rng(0).standard_normal((4, 16, 64)).astype(np.float32)
    plan = plan_for(encoder, "int8", calibration_cases(x, np.zeros((4, 16), bool), 64))
    model = build_graph(encoder, tmp_path / "m.onnx", "int8", attention="mha", plan=plan)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count(int8_ops.ROW_QUANTIZE) == 4 and ops.count(int8_ops.QUANT_MATMUL) == 6
    assert "MatMulInteger" not in ops and "QuantizeLinear" not in ops
    bodies = {f.name: {n.op_type for n in f.node} for f in model.functions}
    assert {f.domain for f in model.functions} == {kernels.DOMAIN}
    assert {"MatMulInteger", "MatMul"} <= bodies[int8_ops.QUANT_MATMUL]
    assert {"QuantizeLinear", "ReduceMin", "ReduceMax"} <= bodies[int8_ops.ROW_QUANTIZE]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    rows = [n for n in model.graph.node if n.op_type == int8_ops.ROW_QUANTIZE]
    keeps = [inits[n.input[2]] for n in rows]  # keep: 0 at the float channels
    chosen = {tuple(sorted(np.flatnonzero(keep == 0))) for keep in keeps}
    assert chosen == {tuple(sorted(c)) for c in plan[FLOAT_CHANNELS_KEY].values()}
    made = {i.name for i in model.graph.input} | set(inits) | {o for n in model.graph.node for o in n.output}
    assert all(i in made for n in model.graph.node for i in n.input if i), "an input no node makes"
