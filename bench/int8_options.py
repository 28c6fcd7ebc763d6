"""int8 schemes a graph could compute, built and timed side by side on a real model (``python -m bench --real``).

The study behind issue 34 item 5: what brings int8 to a sentence cosine >= 0.999 on a trained model, and what
that costs in speed with onnxruntime's own CPU kernels. Each option is export/int8.py's graph (float channels
chosen on the calibration inputs) with one thing changed, or one of onnxruntime's own quantizers:

- ``form``: the int8 variant's form (model.schemes.Form): today's (8-bit pair-bounded weights, rows from their
  least to their largest value around their mean) is the variant's row of the table; the first form (7-bit
  weights, rows +-their reach from their mean) is an option here;
- ``weight_levels``: plain symmetric weights of that many levels (127: 8 bits, unbounded pairs, which saturate
  VPMADDUBSW on CPUs without VNNI) instead of the form's;
- ``float_channels``: whether the float channels are kept at all;
- ``block_size``: instead of all the above, onnxruntime's own block-wise scheme (``MatMulNBits``, 8-bit weights
  with a scale per block of ``block_size`` input channels, ``accuracy_level`` 4: activations quantized to int8 per
  row and block inside the kernel, products summed in int32 per block, blocks summed in float);
- ``static``: onnxruntime's ``quantize_static`` (QDQ, per-channel 8-bit weights, per-tensor activation scales
  calibrated on the real sentences with MinMax; u8 activations, s8 weights, reduce_range for AVX2).

Nothing here is an export variant: it measures candidates; docs/parity.md keeps the table and the choice.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import onnx

from addnorm.model.schemes import LEGACY, Form


@dataclass(frozen=True)
class Option:
    name: str
    float_channels: bool = True
    weight_levels: int | None = None
    form: Form = field(default_factory=Form)
    block_size: int = 0  # > 0: MatMulNBits, 8 bits per block of this many input channels (the rest unused)
    static: bool = False  # onnxruntime's quantize_static, calibrated on the real sentences

    @property
    def probe(self) -> str:
        """Its kernel's name in KERNEL_PROBE."""
        if self.block_size:
            return "nbits8"
        if self.static:
            return "u8s8-63"  # reduce_range: 7-bit weights
        levels = self.weight_levels or {"pairs8": 0, "7bit": 63}[self.form.weights]
        return f"u8s8-{levels}" if levels else "u8s8-pairs"


OPTIONS = (  # the int8 variant itself (today's form, float channels) is the int8 row of the table
    Option("int8, first form (7-bit, around the mean)", form=LEGACY),
    Option("int8, no float channels", float_channels=False),
    Option("8 float channels, plain 8-bit weights", weight_levels=127),
    Option("static QDQ (quantize_static, MinMax)", float_channels=False, static=True),
    Option("MatMulNBits 8 bits, blocks of 32", block_size=32),
    Option("MatMulNBits 8 bits, blocks of 64", block_size=64),
)


def build(pre: onnx.ModelProto, encoder, x: np.ndarray, mask: np.ndarray, option: Option) -> onnx.ModelProto:
    """``option``'s graph from ``pre`` (the fp32 graph after onnxruntime's pre-processing), its float channels
    chosen on (x, mask) as an export with them as --calibration chooses them (and a static one calibrated on
    them)."""
    from addnorm.export import int8

    model = onnx.ModelProto()
    model.CopyFrom(pre)
    if option.block_size:
        return _blockwise(model, option.block_size)
    if option.static:
        return _static(model, x, mask)
    channels_of = None
    if option.float_channels:
        state = {k: v.detach().float().numpy() for k, v in encoder.state_dict().items()}
        channels_of = int8.owner_channels(state, int8.float_channels(encoder, [(x, mask)]))
    int8.quantize_graph(model, channels_of, option.form, weight_levels=option.weight_levels)
    return model


def _static(model: onnx.ModelProto, x: np.ndarray, mask: np.ndarray) -> onnx.ModelProto:
    """onnxruntime's static QDQ quantization, its activation ranges calibrated on (x, mask) a sentence at a time."""
    import tempfile
    from pathlib import Path

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from addnorm.model.contract import EMBEDDINGS, MASK

    class Sentences(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows = iter(range(len(x)))

        def get_next(self) -> dict | None:
            i = next(self.rows, None)
            if i is None:
                return None
            n = int((~mask[i]).sum())
            return {EMBEDDINGS: x[i : i + 1, :n], MASK: mask[i : i + 1, :n]}

    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "pre.onnx", Path(tmp) / "static.onnx"
        onnx.save(model, str(source))
        quantize_static(
            str(source),
            str(out),
            Sentences(),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=True,
            op_types_to_quantize=["MatMul"],
            extra_options={"MatMulConstBOnly": True},
        )
        return onnx.load(str(out))


def _blockwise(model: onnx.ModelProto, block_size: int) -> onnx.ModelProto:
    """onnxruntime's MatMulNBits quantizer: every constant-weight MatMul, 8-bit symmetric weights per block,
    int8 compute (accuracy_level 4)."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, logger.level = logger.level, logging.WARNING  # it logs every node it visits at INFO
    try:
        quantizer = MatMulNBitsQuantizer(
            model, bits=8, block_size=block_size, is_symmetric=True, accuracy_level=4
        )
        quantizer.process()
    finally:
        logger.setLevel(level)
    return quantizer.model.model


# One MatMulInteger per operand pair, with products that saturate a pair sum in int16 (VPMADDUBSW: u8 x s8 on
# CPUs without VNNI); prints each pair's verdict. Run under QEMU's Haswell-v4 it shows what an AVX2-only CPU does.
KERNEL_PROBE = """
import numpy as np, onnxruntime as ort
from onnx import TensorProto as T, helper
cases = {"u8s8-63": (T.UINT8, T.INT8, 255, 63, 0), "u8s8-127": (T.UINT8, T.INT8, 255, 127, 0),
         "u8u8-127": (T.UINT8, T.UINT8, 255, 255, 128), "s8s8-127": (T.INT8, T.INT8, -127, -127, 0)}
o = ort.SessionOptions(); o.log_severity_level = 3
for name, (ta, tb, a, b, zb) in cases.items():
    za = 128 if ta == T.UINT8 else 0
    g = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"])], "g",
        [helper.make_tensor_value_info("a", ta, [4, 64]), helper.make_tensor_value_info("b", tb, [64, 8])],
        [helper.make_tensor_value_info("y", T.INT32, [4, 8])],
        [helper.make_tensor("za", ta, [], [za]), helper.make_tensor("zb", tb, [], [zb])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    s = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
    A = np.full((4, 64), a, np.uint8 if ta == T.UINT8 else np.int8)
    B = np.full((64, 8), b, np.uint8 if tb == T.UINT8 else np.int8)
    y = s.run(None, {"a": A, "b": B})[0]
    want = (A.astype(np.int64) - za) @ (B.astype(np.int64) - zb)
    print(name, "exact" if (y == want).all() else "saturates")
# int8's pair-bounded 8-bit weights at their bound: 127 and 1 in each pair of input channels (2k, 2k + 1)
g = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b", "za"], ["y"])], "g",
    [helper.make_tensor_value_info("a", T.UINT8, [4, 64]), helper.make_tensor_value_info("b", T.INT8, [64, 8])],
    [helper.make_tensor_value_info("y", T.INT32, [4, 8])], [helper.make_tensor("za", T.UINT8, [], [128])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
s = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
A, B = np.full((4, 64), 255, np.uint8), np.tile(np.array([[127], [1]], np.int8), (32, 8))
y = s.run(None, {"a": A, "b": B})[0]
print("u8s8-pairs", "exact" if (y == (A.astype(np.int64) - 128) @ B.astype(np.int64)).all() else "saturates")
# MatMulNBits, 8 bits, int8 compute: activations and weights at +-127 with scale 1 quantize exactly, so the sum
# of 384 products of 127 x 127 (6.2e6, exact in float32) comes out exact unless a pair sum saturates.
from onnx import numpy_helper
K, N = 384, 8
node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=8,
                        block_size=32, accuracy_level=4)
g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", T.FLOAT, [4, K])],
    [helper.make_tensor_value_info("y", T.FLOAT, [4, N])],
    [numpy_helper.from_array(np.full((N, K // 32, 32), 255, np.uint8), "b"),
     numpy_helper.from_array(np.ones(N * K // 32, np.float32), "s")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                      ir_version=9)
s = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
y = s.run(None, {"a": np.full((4, K), 127, np.float32)})[0]
print("nbits8", "exact" if (y == K * 127 * 127).all() else "saturates")
"""


def kernel_exactness(emulate: str | None) -> dict[str, str]:
    """{"<kernel>-<weight levels>": exact|saturates} (Option.probe) on this CPU, or under QEMU's ``emulate`` CPU
    model; {} where QEMU is not installed."""
    cmd = [sys.executable, "-c", KERNEL_PROBE]
    if emulate is not None:
        qemu = shutil.which("qemu-x86_64")
        if qemu is None:
            return {}
        cmd = [qemu, "-cpu", emulate, *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return dict(line.split() for line in done.stdout.splitlines() if line.strip())
