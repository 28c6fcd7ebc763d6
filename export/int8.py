"""The int8 variant's scheme: int8 weights, activations quantized per row; accurate and equal on every x86 CPU kind,
and batch invariant. ``quantize_graph`` writes it into an ONNX graph; ``simulated`` computes it in torch; model/schemes.py holds its
numbers and computes it in numpy (the server's live parity).

Each MatMul whose right operand is a constant (E, N) weight ``W`` becomes, in standard ONNX operators:

    c = mean(x, -1), p = max(|x - c|, -1)              (B, S, 1)  each row's own centre and reach
    q = uint8(round((x - c) * 127 / p) + 128)          (B, S, E)  8 bits per row, zero point 128
    y = ((q - 128) @ Wq) * (p / 127) * w_scale + c * colsum(W)       (B, S, N)

``Wq`` is int8 per output column, symmetric, in [-63, 63] (7 bits); ``colsum(W)`` is the float weights' column
sum, so a row's mean passes through exactly and only its deviation is quantized. onnxruntime fuses
MatMulInteger -> Cast -> Mul(Mul(row scale, column scale)) into one MatMulIntegerToFloat kernel.

Why (docs/parity.md has the measurements):
- A scale per row, never per tensor: a request's answer does not depend on what it was batched with
  (onnxruntime's ``quantize_dynamic`` takes one activation scale per run, i.e. per batch).
- 7-bit weights: on CPUs without VNNI (AVX2, AVX-512 without VNNI) onnxruntime's u8 x s8 kernel adds pairs of
  products in int16 (VPMADDUBSW), which saturates once 2 x 255 x 127 > 32767. With |w| <= 63 a pair is at most
  2 x 255 x 63 = 32130: the int32 sums are exact on every kind, so every kind computes the same answer.
- The exact mean term keeps rows with a large offset accurate (the adversarial suite's 1e2..1e4 offsets): it
  is not spent of the 8 bits.
- The offset term is its own Add: onnxruntime 1.32's MatMulIntegerToFloat multiplies a fused bias by a
  per-row scale, so nothing here may let the optimizer fuse a bias Add into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model.schemes import (  # the scheme's numbers, shared with the server
    HALF,
    TINY,
    ZERO_POINT,
    quantize_weight,
)


def quantize_graph(model: onnx.ModelProto) -> int:
    """Rewrite every float MatMul with a constant 2-D weight in ``model.graph`` in place; returns how many.

    An activation read by several MatMuls (q, k and v read the same input) is quantized once.
    """
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {t.name: t for t in graph.initializer}
    consts = {
        "int8_axes": np.array([-1], np.int64),
        "int8_tiny": np.array(TINY, np.float32),
        "int8_half": np.array(HALF, np.float32),
        "int8_one": np.array(1.0, np.float32),
        "int8_zp": np.array(ZERO_POINT, np.uint8),
    }
    new_inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    rows: dict[str, tuple[str, str, str]] = {}  # activation -> (q, row scale, row mean)
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()

    def reduce(op: str, x: str, out: str) -> onnx.NodeProto:
        if opset >= 18:  # axes became an input in opset 18
            return helper.make_node(op, [x, "int8_axes"], [out], keepdims=1)
        return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)

    def quantized_rows(x: str) -> tuple[str, str, str]:
        if x not in rows:
            p = f"{x}_rows"
            nodes.extend(
                [
                    reduce("ReduceMean", x, f"{p}_mean"),
                    helper.make_node("Sub", [x, f"{p}_mean"], [f"{p}_dev"]),
                    helper.make_node("Abs", [f"{p}_dev"], [f"{p}_abs"]),
                    reduce("ReduceMax", f"{p}_abs", f"{p}_reach"),
                    helper.make_node("Max", [f"{p}_reach", "int8_tiny"], [f"{p}_peak"]),
                    helper.make_node("Div", [f"{p}_peak", "int8_half"], [f"{p}_scale"]),
                    helper.make_node("Div", ["int8_half", f"{p}_peak"], [f"{p}_inv"]),
                    helper.make_node("Mul", [f"{p}_dev", f"{p}_inv"], [f"{p}_levels"]),
                    # round half to even, + zero point, saturate, cast: one operator
                    helper.make_node("QuantizeLinear", [f"{p}_levels", "int8_one", "int8_zp"], [f"{p}_q"]),
                ]
            )
            rows[x] = (f"{p}_q", f"{p}_scale", f"{p}_mean")
        return rows[x]

    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or w.data_type != TensorProto.FLOAT or len(w.dims) != 2:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(w).astype(np.float64)
        wq, w_scale = quantize_weight(weight)
        p = f"{node.name or node.output[0]}_int8"
        new_inits += [
            numpy_helper.from_array(wq, f"{p}_w"),
            numpy_helper.from_array(w_scale, f"{p}_w_scale"),
            numpy_helper.from_array(weight.sum(axis=0).astype(np.float32), f"{p}_colsum"),
        ]
        q, scale, mean = quantized_rows(node.input[0])
        nodes += [
            helper.make_node("MatMulInteger", [q, f"{p}_w", "int8_zp"], [f"{p}_acc"]),
            helper.make_node("Cast", [f"{p}_acc"], [f"{p}_accf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [scale, f"{p}_w_scale"], [f"{p}_scales"]),  # (row scale, column scale)
            helper.make_node("Mul", [f"{p}_accf", f"{p}_scales"], [f"{p}_deviation"]),
            helper.make_node("Mul", [mean, f"{p}_colsum"], [f"{p}_offset"]),
            helper.make_node("Add", [f"{p}_deviation", f"{p}_offset"], [node.output[0]]),
        ]
        replaced.add(w.name)
    read = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in new_inits if t.name in read])
    del graph.node[:]
    graph.node.extend(nodes)
    return len(replaced)


@contextlib.contextmanager
def simulated() -> Iterator[None]:
    """Inside, every ``F.linear`` (the encoder's six weight products per layer) computes the int8 scheme exactly,
    in the dtype of its inputs (export.variants runs it in float64: what this variant can do at best)."""
    import torch
    import torch.nn.functional as F

    linear = F.linear

    def int8_linear(x, weight, bias=None):
        wq, w_scale = quantize_weight(weight.detach().T.double().numpy())  # ONNX's (E, N)
        w_deq = torch.from_numpy(wq.astype(np.float64) * w_scale.astype(np.float64)).to(x.dtype)
        mean = x.mean(-1, keepdim=True)
        dev = x - mean
        peak = dev.abs().amax(-1, keepdim=True).clamp_min(TINY)
        q = torch.round(dev * (HALF / peak)).clamp(-HALF, HALF)  # round half to even, as QuantizeLinear
        y = (q @ w_deq) * (peak / HALF) + mean * weight.sum(1).to(x.dtype)
        return y if bias is None else y + bias

    F.linear = int8_linear
    try:
        yield
    finally:
        F.linear = linear
