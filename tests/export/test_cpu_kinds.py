"""int8 on every x86 CPU kind: the golden check at load, run on an emulated AVX2-only CPU (QEMU's Haswell: no
AVX-512, no VNNI), where onnxruntime's u8 x s8 kernels add pairs of products in int16 (VPMADDUBSW).

The emulator is first shown to reproduce that saturation, so a pass here is not a machine that never reached the
AVX2 kernels. .ci/run installs qemu-user; where it cannot be had the tests say so and skip (in CI they fail).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from addnorm.model.runtime import cpu_flags
from tests.cpu_kinds import (
    CAN_EMULATE,
    EXACT,
    PAIRS_K,
    SATURATED,
    WHY_NOT,
    emulated,
    golden_check,
    run,
    saturation_probe,
)

needs_qemu = pytest.mark.skipif(not CAN_EMULATE, reason=WHY_NOT)  # every test but the last, which only parses


@needs_qemu
def test_the_emulated_cpu_saturates_u8s8_pairs_as_avx2_does(tmp_path):
    """255 x 127 summed over 64 products: exact on VNNI, and int16-saturated pairs on AVX2."""
    probe = str(saturation_probe(tmp_path / "m.onnx"))
    code = (
        "import sys, numpy as np, onnxruntime as ort; "
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']); "
        f"print(int(s.run(None, {{'a': np.full((1, {PAIRS_K}), 255, np.uint8)}})[0][0, 0]))"
    )
    assert int(run(emulated("-c", code, probe))) == SATURATED  # every pair saturated
    assert int(run([sys.executable, "-c", code, probe])) in (EXACT, SATURATED)


@needs_qemu
def test_int8_passes_its_golden_check_on_avx2_with_the_same_answers(model_repository, tmp_path):
    """The repository's int8 artifact: passed natively and on the AVX2-only CPU, and the answers are bitwise
    equal (the int32 sums are exact on both; the float work around them is the same)."""
    directory = model_repository / "b-int8"
    native = golden_check(directory, tmp_path / "native.npz", emulate=False)
    avx2 = golden_check(directory, tmp_path / "avx2.npz", emulate=True)
    assert native["status"] == "passed" and avx2["status"] == "passed", (native, avx2)
    a, b = np.load(tmp_path / "native.npz"), np.load(tmp_path / "avx2.npz")
    for case in a.files:
        np.testing.assert_allclose(b[case], a[case], rtol=0, atol=1e-6)  # float32 noise of the float ops only


@needs_qemu
def test_per_tensor_u8s8_quantization_fails_the_golden_check_on_avx2(model_repository, tmp_path):
    """What onnxruntime's quantize_dynamic writes (8-bit weights, per-tensor u8 activations), judged by the int8
    tolerance: refused on the emulated AVX2 CPU. This is the scheme the per-row one replaced."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from addnorm.export.variants import VARIANTS, _toposort
    from addnorm.model.artifact import MANIFEST_FILE, MODEL_FILE, sha256_file

    old = tmp_path / "old"
    shutil.copytree(model_repository / "a-fp32", old)
    pre, q = tmp_path / "pre.onnx", tmp_path / "q.onnx"
    quant_pre_process(str(old / MODEL_FILE), str(pre))
    quantize_dynamic(pre, q, weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})
    model = onnx.load(str(q))
    _toposort(model.graph)
    onnx.save(model, str(old / MODEL_FILE))
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    manifest["variant"] = "int8"
    manifest["model_sha256"] = sha256_file(old / MODEL_FILE)
    manifest["parity"]["tolerance"] = {
        **manifest["parity"]["tolerance"],
        **dataclasses.asdict(VARIANTS["int8"].tolerance),
    }
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    avx2 = golden_check(old, tmp_path / "avx2.npz", emulate=True)
    assert avx2["status"] == "failed" and "worst row relative RMS" in avx2["message"], avx2


def test_a_failed_int8_check_on_a_cpu_without_vnni_names_the_cause(tmp_path):
    from addnorm.service.backend.engine import int8_cpu_hint

    avx2 = tmp_path / "cpuinfo"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert cpu_flags(str(avx2)) == {"avx2"}
    hint = int8_cpu_hint(cpu_flags(str(avx2)))
    assert "no VNNI" in hint and "avx2" in hint and "re-export" in hint
    vnni = tmp_path / "vnni"
    vnni.write_text("flags\t\t: avx2 avx512f avx512bw avx512_vnni\n")
    assert int8_cpu_hint(cpu_flags(str(vnni))) == ""


@needs_qemu
def test_pair_bounded_8_bit_weights_are_exact_on_avx2_where_plain_8_bit_ones_saturate(tmp_path):
    """int8's weights (model.schemes.quantize_weight_pairs): up to 127 levels, and no two input channels 2k, 2k + 1
    of a column whose same-sign levels sum past 128. Against activations at 255 (the largest u8), on weights made
    to be hard (columns of equal values, and columns with one large value per pair): the emulated AVX2 CPU's
    int32 sums are exact with them, and saturate with plain 8-bit weights of the same matrix."""
    from addnorm.model.schemes import quantize_weight, quantize_weight_pairs

    rng = np.random.default_rng(3)
    k, n = 96, 16
    w = rng.standard_normal((k, n))
    w[:, :4] = 1.0  # every pair at the column's peak
    w[:, 4:8] = -1.0
    w[0::2, 8:12] *= 8.0  # one large member per pair
    bounded, _ = quantize_weight_pairs(w)
    plain, _ = quantize_weight(w, 127)
    assert np.abs(bounded).max() == 127
    code = (
        "import sys, numpy as np, onnxruntime as ort; "
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']); "
        f"np.save(sys.argv[2], s.run(None, {{'a': np.full((3, {k}), 255, np.uint8)}})[0])"
    )
    for label, q in (("bounded", bounded), ("plain", plain)):
        graph = helper.make_graph(
            [helper.make_node("MatMulInteger", ["a", "w", "za"], ["y"])],
            "g",
            [helper.make_tensor_value_info("a", TensorProto.UINT8, [3, k])],
            [helper.make_tensor_value_info("y", TensorProto.INT32, [3, n])],
            [numpy_helper.from_array(q, "w"), numpy_helper.from_array(np.array(128, np.uint8), "za")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, str(tmp_path / f"{label}.onnx"))
        run(emulated("-c", code, str(tmp_path / f"{label}.onnx"), str(tmp_path / f"{label}.npy")))
        got, want = np.load(tmp_path / f"{label}.npy"), np.full((3, k), 127) @ q.astype(np.int64)
        if label == "bounded":
            np.testing.assert_array_equal(got, want)
        else:
            assert (got != want).any()
