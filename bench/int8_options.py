"""int8 schemes a graph could compute, built and timed side by side on a real model (``python -m bench --real``).

The study behind issue 34 item 5: what would bring int8 to a sentence cosine >= 0.999 on a trained model, and what
that costs in speed with onnxruntime's own CPU kernels. Each option is export/int8.py's graph (float channels
chosen on the calibration inputs, activations per row around their mean) with one thing changed:

- ``weight_levels``: 63 (7 bits, the scheme's: exact in onnxruntime's u8 x s8 kernel on every x86 CPU) or 127;
- ``kernel``: MatMulInteger's operand types: u8s8 (the scheme's), u8u8 (weights stored around 128 too) or s8s8
  (activations int8 around 0);
- ``float_channels``: whether the float channels are kept at all;
- ``block_size``: instead of all the above, onnxruntime's own block-wise scheme (``MatMulNBits``, 8-bit weights
  with a scale per block of ``block_size`` input channels, ``accuracy_level`` 4: activations quantized to int8 per
  row and block inside the kernel, products summed in int32 per block, blocks summed in float).

Nothing here is an export variant: it measures candidates; docs/parity.md keeps the table and the choice.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import onnx


@dataclass(frozen=True)
class Option:
    name: str
    float_channels: bool = True
    weight_levels: int = 63
    kernel: str = "u8s8"  # u8s8, u8u8 or s8s8
    block_size: int = 0  # > 0: MatMulNBits, 8 bits per block of this many input channels (the rest unused)

    @property
    def probe(self) -> str:
        """Its kernel's name in KERNEL_PROBE."""
        return "nbits8" if self.block_size else f"{self.kernel}-{self.weight_levels}"


OPTIONS = (  # 8 float channels with 7-bit weights, u8s8, is export/int8.py's scheme (the int8 row of the table)
    Option("8 float channels, 8+8 bits u8s8", True, 127),
    Option("8 float channels, 8+8 bits u8u8", True, 127, "u8u8"),
    Option("8 float channels, 8+8 bits s8s8", True, 127, "s8s8"),
    Option("8+8 bits u8u8, no float channels", False, 127, "u8u8"),
    Option("MatMulNBits 8 bits, blocks of 32", block_size=32),
    Option("MatMulNBits 8 bits, blocks of 64", block_size=64),
)


def build(pre: onnx.ModelProto, encoder, x: np.ndarray, mask: np.ndarray, option: Option) -> onnx.ModelProto:
    """``option``'s graph from ``pre`` (the fp32 graph after onnxruntime's pre-processing), its float channels
    chosen on (x, mask) as an export with them as --calibration chooses them."""
    from export import int8

    model = onnx.ModelProto()
    model.CopyFrom(pre)
    if option.block_size:
        return _blockwise(model, option.block_size)
    channels_of = None
    if option.float_channels:
        state = {k: v.detach().float().numpy() for k, v in encoder.state_dict().items()}
        channels_of = int8.owner_channels(state, int8.float_channels(encoder, [(x, mask)]))
    int8.quantize_graph(model, channels_of, option.weight_levels, option.kernel)
    return model


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
