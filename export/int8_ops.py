"""int8's two steps as ONNX model-local functions: what any runtime computes, and what model/kernels speeds up.

export/int8.py writes each quantized activation's rows as one ``ai.addnorm.RowQuantize`` node and each weight
product as one ``ai.addnorm.QuantMatMul`` node. Their bodies, below, are the scheme in standard operators: a
runtime that knows no such operator (onnxruntime without our library, Triton's onnxruntime backend, the CUDA
provider) inlines them, and computes the same graph as before they were functions. onnxruntime with
model/kernels' library registered runs its kernels for them instead: the same arithmetic (the same levels and
integer products; the float side summed in another order) in one pass per activation and one per product.

    RowQuantize(x (..., E), pick (E, F + 1), keep (E)) -> q (..., E) uint8, step (..., 1), side (..., F + 3)
        [x[F], c] = x @ pick; d = (x - c) * keep; step = max(max(d) - min(d), TINY) / 254;
        z = round(-min(d) / step) (saturated to 0..255); q = round(d / step) + z (per row; saturated);
        side = [x[F], c, (128 - z) step, 1]
    QuantMatMul(q, step, side, w (E, N) int8, w_scale (N), side_w (J, N)) -> y (..., N)
        y = ((q - 128) @ w) * (step * w_scale) + side @ side_w

``pick``: one-hot columns selecting the float channels F, then a column of ``keep / |keep|`` (the row's mean over
the other channels); ``keep``: 0 at F, 1 elsewhere. model.schemes holds the numbers; export/int8.py the reasons.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from addnorm.model.kernels import DOMAIN
from addnorm.model.schemes import STEPS, TINY, ZERO_POINT

ROW_QUANTIZE = "RowQuantize"
QUANT_MATMUL = "QuantMatMul"


def functions(opset: int) -> list[onnx.FunctionProto]:
    """The two functions for a graph of ``opset`` (the default domain's version)."""
    imports = [helper.make_opsetid("", opset)]
    return [
        helper.make_function(
            DOMAIN, ROW_QUANTIZE, ["x", "pick", "keep"], ["q", "step", "side"], _rows(opset), imports
        ),
        helper.make_function(
            DOMAIN, QUANT_MATMUL, ["q", "step", "side", "w", "w_scale", "side_w"], ["y"], _product(), imports
        ),
    ]


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _rows(opset: int) -> list[onnx.NodeProto]:
    def reduce(op: str, x: str, out: str) -> onnx.NodeProto:
        if opset >= 18:  # axes became an input in opset 18
            return helper.make_node(op, [x, "last"], [out], keepdims=1)
        return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)

    return [
        _const("last", np.array([-1], np.int64)),
        _const("end", np.array([np.iinfo(np.int64).max], np.int64)),
        _const("tiny", np.array(TINY, np.float32)),
        _const("steps", np.array(STEPS, np.float32)),
        _const("minus", np.array(-1.0, np.float32)),
        _const("zero", np.array(0, np.uint8)),  # "minmax" rows are stored 0..255
        _const("centre", np.array(ZERO_POINT, np.float32)),
        # one small GEMM gives the float channels exactly and the mean of the others (several times faster than a
        # Gather on the last axis); the mean is its last column
        helper.make_node("MatMul", ["x", "pick"], ["float"]),
        helper.make_node("Slice", ["float", "last", "end", "last"], ["c"]),
        helper.make_node("Sub", ["x", "c"], ["centred"]),
        helper.make_node("Mul", ["centred", "keep"], ["kept"]),  # the float channels at 0: out of the span
        reduce("ReduceMin", "kept", "lo"),
        reduce("ReduceMax", "kept", "hi"),
        helper.make_node("Sub", ["hi", "lo"], ["width"]),
        helper.make_node("Max", ["width", "tiny"], ["span"]),
        helper.make_node("Div", ["span", "steps"], ["step"]),
        helper.make_node("Div", ["lo", "step"], ["below"]),
        # the row's zero point, round(-lo / step): round half to even, saturate to 0..255
        helper.make_node("QuantizeLinear", ["below", "minus", "zero"], ["z"]),
        # each row with its own scale and zero point: per axis 0 of a 2-D view
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Flatten", ["kept"], ["rows"], axis=-1),
        helper.make_node("Reshape", ["step", "last"], ["steps1"]),
        helper.make_node("Reshape", ["z", "last"], ["zs1"]),
        helper.make_node("QuantizeLinear", ["rows", "steps1", "zs1"], ["q2"], axis=0),
        helper.make_node("Reshape", ["q2", "shape"], ["q"]),
        # the value level 128 stands for (the product takes the levels around it)
        helper.make_node("Cast", ["z"], ["zf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["centre", "zf"], ["lift"]),
        helper.make_node("Mul", ["lift", "step"], ["base"]),
        helper.make_node("Div", ["span", "span"], ["one"]),  # 1 exactly
        helper.make_node("Concat", ["float", "base", "one"], ["side"], axis=-1),
    ]


def _product() -> list[onnx.NodeProto]:
    # onnxruntime fuses MatMulInteger -> Cast -> Mul(Mul(row scale, column scale)) into one MatMulIntegerToFloat.
    # The bias rides on the float side: its MatMulIntegerToFloat would multiply a fused bias by the row scale.
    return [
        _const("zp", np.array(ZERO_POINT, np.uint8)),
        helper.make_node("MatMulInteger", ["q", "w", "zp"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["step", "w_scale"], ["scales"]),  # (row scale, column scale)
        helper.make_node("Mul", ["accf", "scales"], ["deviation"]),
        helper.make_node("MatMul", ["side", "side_w"], ["offset"]),  # float channels + carried terms + bias
        helper.make_node("Add", ["deviation", "offset"], ["y"]),
    ]
