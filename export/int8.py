"""The int8 variant's scheme: int8 weights, activations quantized per row; accurate and equal on every x86 CPU kind,
and batch invariant. ``quantize_graph`` writes it into an ONNX graph; ``simulated`` computes it in torch; model/schemes.py holds its
numbers and computes it in numpy (the server's live parity).

Each MatMul whose right operand is a constant (E, N) weight ``W`` becomes, in standard ONNX operators:

    c = mean(x, -1), p = max(|x - c|, -1)              (B, S, 1)  each row's own centre and reach
    q = uint8(round((x - c) * 127 / p) + 128)          (B, S, E)  8 bits per row, zero point 128
    y = ((q - 128) @ Wq) * (p / 127) * w_scale + [x[F], c] @ [W[F]; colsum(W')]     (B, S, N)

``F``: a few input channels (``model.schemes.float_channel_count``: 8 on a 384-wide input) with the largest peaks
on representative inputs, chosen at export (``float_channels``) and named in the manifest's ``scheme``; they are
left out of the row's deviation (its reach and its 8 bits) and multiplied in float. ``W'`` is ``W`` with the rows
of ``F`` zeroed; ``Wq`` is ``W'`` in int8 per output column, symmetric, in [-63, 63] (7 bits); ``colsum(W')`` is
its float column sum, so a row's mean passes through exactly and only its deviation is quantized. onnxruntime
fuses MatMulInteger -> Cast -> Mul(Mul(row scale, column scale)) into one MatMulIntegerToFloat kernel.

Why (docs/parity.md has the measurements):
- A scale per row, never per tensor: a request's answer does not depend on what it was batched with
  (onnxruntime's ``quantize_dynamic`` takes one activation scale per run, i.e. per batch).
- 7-bit weights: on CPUs without VNNI (AVX2, AVX-512 without VNNI) onnxruntime's u8 x s8 kernel adds pairs of
  products in int16 (VPMADDUBSW), which saturates once 2 x 255 x 127 > 32767. With |w| <= 63 a pair is at most
  2 x 255 x 63 = 32130: the int32 sums are exact on every kind, so every kind computes the same answer.
- The exact mean term keeps rows with a large offset accurate (the adversarial suite's 1e2..1e4 offsets): it
  is not spent of the 8 bits.
- The float channels: a trained BERT has a few hidden dimensions 5-20x larger than the rest (all-MiniLM-L6-v2:
  28 against a median of 1.5 at a feed-forward input); one of them sets a row's reach and every other channel
  loses 3-4 of its 8 bits. On that model's real sentences they take the least sentence cosine against
  transformers from 0.9933 to 0.9984 for 5-11% of the speed (docs/parity.md, "int8 on the real model").
- The offset term is its own Add: onnxruntime 1.32's MatMulIntegerToFloat multiplies a fused bias by a
  per-row scale, so nothing here may let the optimizer fuse a bias Add into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model.schemes import (  # the scheme's numbers, shared with the server
    HALF,
    TINY,
    WEIGHT_MAX,
    ZERO_POINT,
    Exact,
    float_channel_count,
    quantize_weight,
)

ChannelsOf = Callable[[np.ndarray], np.ndarray]  # a graph weight (E, N) -> its float input channels


def quantize_graph(
    model: onnx.ModelProto,
    channels_of: ChannelsOf | None = None,
    weight_levels: int = WEIGHT_MAX,
    kernel: str = "u8s8",
) -> int:
    """Rewrite every float MatMul with a constant 2-D weight in ``model.graph`` in place; returns how many.
    ``channels_of(W)``: the input channels of weight ``W`` (E, N) to keep in float (``owner_channels``); none
    without it. ``weight_levels`` and ``kernel`` (MatMulInteger's operands: u8s8, the scheme's; u8u8 with
    weights stored around 128; s8s8 with activations around 0) exist for bench/int8_options.py's study of
    other schemes: the int8 variant and the schemes of model/schemes.py are the defaults'.

    An activation read by several MatMuls with the same float channels (q, k and v read the same input) is
    quantized once.
    """
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {t.name: t for t in graph.initializer}
    consts = {
        "int8_axes": np.array([-1], np.int64),
        "int8_tiny": np.array(TINY, np.float32),
        "int8_half": np.array(HALF, np.float32),
        "int8_one": np.array(1.0, np.float32),
        "int8_zp": np.array(0, np.int8) if kernel == "s8s8" else np.array(ZERO_POINT, np.uint8),
        "int8_w_zp": np.array(ZERO_POINT, np.uint8),  # u8u8's weights
    }
    new_inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    rows: dict[tuple[str, tuple[int, ...]], tuple[str, str, str]] = {}  # -> (q, row scale, float side)
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()

    def reduce(op: str, x: str, out: str) -> onnx.NodeProto:
        if opset >= 18:  # axes became an input in opset 18
            return helper.make_node(op, [x, "int8_axes"], [out], keepdims=1)
        return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)

    def quantized_rows(x: str, idx: np.ndarray, width: int) -> tuple[str, str, str]:
        key = (x, tuple(int(i) for i in idx))
        if key not in rows:
            p = f"{x}_rows{len(rows) or ''}"
            nodes.extend(
                [
                    reduce("ReduceMean", x, f"{p}_mean"),
                    helper.make_node("Sub", [x, f"{p}_mean"], [f"{p}_dev"]),
                ]
            )
            dev, side = f"{p}_dev", f"{p}_mean"
            if len(idx):  # the float channels leave the deviation and join the mean on the float side
                keep = np.ones(width, np.float32)
                keep[idx] = 0.0
                new_inits.append(numpy_helper.from_array(keep, f"{p}_keep"))
                new_inits.append(numpy_helper.from_array(idx, f"{p}_channels"))
                nodes.extend(
                    [
                        helper.make_node("Mul", [dev, f"{p}_keep"], [f"{p}_kept"]),
                        helper.make_node("Gather", [x, f"{p}_channels"], [f"{p}_float"], axis=-1),
                        helper.make_node("Concat", [f"{p}_float", f"{p}_mean"], [f"{p}_side"], axis=-1),
                    ]
                )
                dev, side = f"{p}_kept", f"{p}_side"
            nodes.extend(
                [
                    helper.make_node("Abs", [dev], [f"{p}_abs"]),
                    reduce("ReduceMax", f"{p}_abs", f"{p}_reach"),
                    helper.make_node("Max", [f"{p}_reach", "int8_tiny"], [f"{p}_peak"]),
                    helper.make_node("Div", [f"{p}_peak", "int8_half"], [f"{p}_scale"]),
                    helper.make_node("Div", ["int8_half", f"{p}_peak"], [f"{p}_inv"]),
                    helper.make_node("Mul", [dev, f"{p}_inv"], [f"{p}_levels"]),
                    # round half to even, + zero point, saturate, cast: one operator
                    helper.make_node("QuantizeLinear", [f"{p}_levels", "int8_one", "int8_zp"], [f"{p}_q"]),
                ]
            )
            rows[key] = (f"{p}_q", f"{p}_scale", side)
        return rows[key]

    w_zp = ["int8_w_zp"] if kernel == "u8u8" else []
    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or w.data_type != TensorProto.FLOAT or len(w.dims) != 2:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(w)
        idx = np.sort(np.asarray(channels_of(weight) if channels_of else [], np.int64))
        rest = weight.astype(np.float64)
        rest[idx] = 0.0
        wq, w_scale = quantize_weight(rest, weight_levels)
        if kernel == "u8u8":
            wq = (wq.astype(np.int16) + ZERO_POINT).astype(np.uint8)
        side_w = np.concatenate([weight[idx].astype(np.float64), rest.sum(axis=0, keepdims=True)])
        p = f"{node.name or node.output[0]}_int8"
        new_inits += [
            numpy_helper.from_array(wq, f"{p}_w"),
            numpy_helper.from_array(w_scale, f"{p}_w_scale"),
            numpy_helper.from_array(side_w.astype(np.float32), f"{p}_side_w"),
        ]
        q, scale, side = quantized_rows(node.input[0], idx, weight.shape[0])
        nodes += [
            helper.make_node("MatMulInteger", [q, f"{p}_w", "int8_zp", *w_zp], [f"{p}_acc"]),
            helper.make_node("Cast", [f"{p}_acc"], [f"{p}_accf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [scale, f"{p}_w_scale"], [f"{p}_scales"]),  # (row scale, column scale)
            helper.make_node("Mul", [f"{p}_accf", f"{p}_scales"], [f"{p}_deviation"]),
            helper.make_node("MatMul", [side, f"{p}_side_w"], [f"{p}_offset"]),  # float channels + mean term
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


def input_peaks(encoder, inputs: list[tuple[np.ndarray, np.ndarray]], real_only: bool = True) -> dict:
    """Per weight product of ``encoder`` (by weight name), the largest |input| per channel over ``inputs`` ((x, mask)
    pairs, batch first), over real tokens only unless ``real_only`` is False. model/reference.py in float64."""
    from model import reference

    weights = {k: v.detach().double().numpy() for k, v in encoder.state_dict().items()}
    names = {id(v): k for k, v in weights.items()}
    peaks: dict[str, np.ndarray] = {}
    counted = np.zeros(0, bool)

    class Record(Exact):
        def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
            name = names[id(weight)]
            seen = np.abs(x[counted]).max(axis=0) if counted.any() else np.zeros(x.shape[-1])
            peaks[name] = np.maximum(peaks.get(name, 0.0), seen)
            return x @ weight.T + bias

    for x, mask in inputs:  # forward takes the graph's layout and runs batch first inside
        counted = ~np.asarray(mask, bool) if real_only else np.ones(np.shape(mask), bool)
        graph_x = x if encoder.config.batch_first else x.transpose(1, 0, 2)
        reference.forward(encoder.config, weights, graph_x.astype(np.float64), mask, Record())
    return peaks


def float_channels(encoder, inputs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, list[int]]:
    """Per weight product of ``encoder`` (by weight name), the ``float_channel_count`` input channels with the
    largest peaks over the real tokens of ``inputs`` (representative ones), largest first."""
    return {
        name: [int(i) for i in np.argsort(-peak, kind="stable")[: float_channel_count(len(peak))]]
        for name, peak in input_peaks(encoder, inputs).items()
    }


def owner_channels(state: Mapping[str, np.ndarray], channels: Mapping[str, list[int]]) -> ChannelsOf:
    """``channels_of`` for ``quantize_graph``: a graph weight (E, N) is the transpose of rows of one torch weight
    (q, k and v are row blocks of one in_proj weight); its float channels are that weight's. A graph weight no
    torch weight holds is an error (the scheme would compute something else)."""
    owners: dict[bytes, list[str]] = {}
    for name in channels:
        for row in np.asarray(state[name], np.float32):
            owners.setdefault(row.tobytes(), []).append(name)

    def channels_of(weight: np.ndarray) -> np.ndarray:
        columns = [np.ascontiguousarray(weight[:, j], np.float32).tobytes() for j in range(weight.shape[1])]
        for name in dict.fromkeys(owners.get(columns[0], [])):  # equal rows in two weights: check them all
            if all(name in owners.get(c, ()) for c in columns):
                return np.asarray(channels[name], np.int64)
        raise ValueError(f"a {list(weight.shape)} graph weight matches no weight of the encoder")

    return channels_of


@contextlib.contextmanager
def simulated(module=None, channels: Mapping[str, list[int]] | None = None) -> Iterator[None]:
    """Inside, every ``F.linear`` (the encoder's six weight products per layer) computes the int8 scheme exactly,
    in the dtype of its inputs (export.variants runs it in float64: what this variant can do at best);
    ``channels``: the float channels by weight name of ``module``'s parameters (a view of one, as q of in_proj,
    is found by its storage)."""
    import torch
    import torch.nn.functional as F

    linear = F.linear
    by_storage = {}
    if channels:
        by_storage = {
            t.untyped_storage().data_ptr(): torch.as_tensor(channels[name], dtype=torch.long)
            for name, t in module.state_dict().items()
            if name in channels
        }

    def int8_linear(x, weight, bias=None):
        idx = by_storage.get(weight.untyped_storage().data_ptr(), torch.zeros(0, dtype=torch.long))
        rest = weight.detach().T.double().numpy().copy()  # ONNX's (E, N)
        rest[idx.numpy()] = 0.0
        wq, w_scale = quantize_weight(rest)
        w_deq = torch.from_numpy(wq.astype(np.float64) * w_scale.astype(np.float64)).to(x.dtype)
        colsum = torch.from_numpy(rest.sum(axis=0)).to(x.dtype)
        mean = x.mean(-1, keepdim=True)
        dev = x - mean
        dev[..., idx] = 0.0
        peak = dev.abs().amax(-1, keepdim=True).clamp_min(TINY)
        q = torch.round(dev * (HALF / peak)).clamp(-HALF, HALF)  # round half to even, as QuantizeLinear
        y = (q @ w_deq) * (peak / HALF) + (mean * colsum + x[..., idx] @ weight.T[idx].to(x.dtype))
        return y if bias is None else y + bias

    F.linear = int8_linear
    try:
        yield
    finally:
        F.linear = linear
