"""The int8 variant's scheme: int8 weights, activations quantized per row; accurate and equal on every x86 CPU kind,
and batch invariant. ``quantize_graph`` writes it into an ONNX graph; ``simulated`` computes it in torch;
model/schemes.py holds its numbers and computes it in numpy (the server's live parity). The manifest's ``scheme``
names its form (``model.schemes.Form``); what follows is today's, "pairs8" weights and "minmax" rows.

Each MatMul whose right operand is a constant (E, N) weight ``W`` becomes (in two model-local functions,
export/int8_ops.py: ``RowQuantize`` per activation, ``QuantMatMul`` per product; their bodies are standard ONNX
operators, and model/kernels' library computes each in one pass where onnxruntime has it registered):

    [x[F], c] = x @ [one-hot(F), keep / |keep|]       (B, S, |F| + 1)  the float channels; the others' mean
    d = (x - c) * keep                                 (B, S, E)  each row around its mean, float channels 0
    s = (max(d) - min(d)) / 254, z = round(-min(d) / s)   (B, S, 1)  its own step and zero point
    q = uint8(round(d / s) + z)                        (B, S, E)  QuantizeLinear per axis over the rows
    y = ((q - 128) @ Wq) * s * w_scale + [x[F], c, (128 - z) s, 1] @ [W[F]; colsum(W'); colsum(Wq'); b]

``F``: a few input channels (``model.schemes.float_channel_count``: 8 on a 384-wide input) with the largest peaks
on representative inputs, chosen at export (``float_channels``) and named in the manifest's ``scheme``; they leave
the row's span and are multiplied in float. ``W'`` is ``W`` with the rows of ``F`` zeroed; ``Wq`` is ``W'`` in 8
bits per output column, every pair of input channels bounded (below), ``Wq'`` its dequantized value; the mean
``c`` passes through the float weights exactly, so only each value's distance from it is quantized. The Linear's
bias ``b`` is folded into the float side. Inlined, onnxruntime fuses MatMulInteger -> Cast -> Mul(Mul(row scale,
column scale)) into one MatMulIntegerToFloat kernel.

Why (docs/parity.md has the measurements):
- A scale per row, never per tensor: a request's answer does not depend on what it was batched with
  (onnxruntime's ``quantize_dynamic`` takes one activation scale per run, i.e. per batch).
- Pair-bounded 8-bit weights: on CPUs without VNNI (AVX2, AVX-512 without VNNI) onnxruntime's u8 x s8 kernel adds
  the products of input channels 2k and 2k + 1 in int16 (VPMADDUBSW), which saturates past 32767 = 255 x 128.5.
  Each column's scale keeps every such pair's same-sign levels within 128 (``quantize_weight_pairs``): the int32
  sums are exact on every kind, so every kind computes the same answer, with 8-bit weights where plain ones would
  saturate and 7-bit ones (the first form's) lose a bit.
- Rows over their own least to largest value (the first form: +-their reach from the mean, half of it unused on a
  skewed row such as a GELU output), around their mean: a row's offset costs none of its bits (the adversarial
  suite's 1e2..1e4 offsets), and the weights' rounding meets only each value's distance from it.
- The float channels: a trained BERT has a few hidden dimensions 5-20x larger than the rest (all-MiniLM-L6-v2:
  28 against a median of 1.5 at a feed-forward input); one of them would set a row's span and every other channel
  lose 3-4 of its 8 bits. On that model's real sentences the least sentence cosine against transformers is
  0.9995 with them, 0.998 without (docs/parity.md, "int8 on the real model").
- The bias and the float side are one small MatMul and one Add: onnxruntime 1.32's MatMulIntegerToFloat
  multiplies a fused bias by a per-row scale, so nothing here may let the optimizer fuse a bias into it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from addnorm.export import int8_ops
from addnorm.export.int8_ops import QUANT_MATMUL, ROW_QUANTIZE
from addnorm.model.kernels import DOMAIN
from addnorm.model.schemes import (  # the scheme's numbers, shared with the server
    DEFAULT_FORM,
    HALF,
    STEPS,
    TINY,
    ZERO_POINT,
    Exact,
    Form,
    float_channel_count,
    quantize_weight,
)

ChannelsOf = Callable[[np.ndarray], np.ndarray | None]  # a graph weight (E, N) -> its float input channels
# (None: the whole product stays float)


def quantize_graph(
    model: onnx.ModelProto,
    channels_of: ChannelsOf | None = None,
    form: Form = DEFAULT_FORM,
    weight_levels: int | None = None,
) -> int:
    """Rewrite every float MatMul with a constant 2-D weight in ``model.graph`` in place; returns how many.
    ``channels_of(W)``: the input channels of weight ``W`` (E, N) to keep in float (``owner_channels``); none
    without it. ``form``: the scheme's form (model.schemes.Form: the weights' and the rows' quantization).
    ``weight_levels`` (plain symmetric weights of that many levels instead of the form's) exists for
    bench/int8_options.py's study of other schemes.

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
        "int8_zp": np.array(ZERO_POINT, np.uint8),
    }
    new_inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    rows: dict[tuple[str, tuple[int, ...]], tuple[str, str, str]] = {}  # -> (q, row step, float side)
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()

    def reduce(op: str, x: str, out: str) -> onnx.NodeProto:
        if opset >= 18:  # axes became an input in opset 18
            return helper.make_node(op, [x, "int8_axes"], [out], keepdims=1)
        return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)

    def quantized_rows(x: str, idx: np.ndarray, width: int) -> tuple[str, str, str]:
        """model.schemes.Form.rows_of in graph operators: (levels as uint8, step, the float side's input:
        the float channels, then base and centre ("minmax") or the mean ("mean"))."""
        key = (x, tuple(int(i) for i in idx))
        if key in rows:
            return rows[key]
        p = f"{x}_rows{len(rows) or ''}"
        keep = np.ones(width, np.float32)
        keep[idx] = 0.0
        if form.rows == "minmax":  # one RowQuantize (export/int8_ops.py)
            pick = np.zeros((width, len(idx) + 1), np.float32)
            pick[idx, np.arange(len(idx))] = 1.0
            pick[:, -1] = keep / keep.sum()
            new_inits.extend(
                [numpy_helper.from_array(pick, f"{p}_pick"), numpy_helper.from_array(keep, f"{p}_keep")]
            )
            outputs = [f"{p}_q", f"{p}_scale", f"{p}_side"]
            nodes.append(
                helper.make_node(ROW_QUANTIZE, [x, f"{p}_pick", f"{p}_keep"], outputs, domain=DOMAIN)
            )
        else:
            nodes.extend(
                [
                    reduce("ReduceMean", x, f"{p}_mean"),
                    helper.make_node("Sub", [x, f"{p}_mean"], [f"{p}_dev"]),
                ]
            )
            dev, floats = f"{p}_dev", []
            if len(idx):  # the float channels leave the deviation and join the mean on the float side
                pick = np.zeros((width, len(idx)), np.float32)
                pick[idx, np.arange(len(idx))] = 1.0
                new_inits.append(numpy_helper.from_array(pick, f"{p}_pick"))
                new_inits.append(numpy_helper.from_array(keep, f"{p}_keep"))
                nodes.append(helper.make_node("MatMul", [x, f"{p}_pick"], [f"{p}_float"]))
                nodes.append(helper.make_node("Mul", [dev, f"{p}_keep"], [f"{p}_kept"]))
                dev, floats = f"{p}_kept", [f"{p}_float"]
            nodes.extend(
                [
                    helper.make_node("Abs", [dev], [f"{p}_abs"]),
                    reduce("ReduceMax", f"{p}_abs", f"{p}_reach"),
                    helper.make_node("Max", [f"{p}_reach", "int8_tiny"], [f"{p}_peak"]),
                    helper.make_node("Div", [f"{p}_peak", f"{p}_peak"], [f"{p}_one"]),  # 1 exactly
                    helper.make_node("Concat", [*floats, f"{p}_mean", f"{p}_one"], [f"{p}_side"], axis=-1),
                    helper.make_node("Div", [f"{p}_peak", "int8_half"], [f"{p}_scale"]),
                    helper.make_node("Div", ["int8_half", f"{p}_peak"], [f"{p}_inv"]),
                    helper.make_node("Mul", [dev, f"{p}_inv"], [f"{p}_levels"]),
                    # round half to even, + zero point, saturate, cast: one operator
                    helper.make_node("QuantizeLinear", [f"{p}_levels", "int8_one", "int8_zp"], [f"{p}_q"]),
                ]
            )
        rows[key] = (f"{p}_q", f"{p}_scale", f"{p}_side")
        return rows[key]

    biases = _bias_adds(graph, inits)
    folded = {add.name for add in biases.values()}
    for node in graph.node:
        if node.name in folded:
            continue
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or w.data_type != TensorProto.FLOAT or len(w.dims) != 2:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(w)
        chosen = channels_of(weight) if channels_of else []
        if chosen is None:  # a product the scheme keeps in float (a head's: model.schemes.Exact.float_linear)
            nodes.extend([node, *([biases[node.output[0]]] if node.output[0] in biases else [])])
            continue
        idx = np.sort(np.asarray(chosen, np.int64))
        rest = weight.astype(np.float64)
        rest[idx] = 0.0
        wq, w_scale = form.quantize(rest) if weight_levels is None else quantize_weight(rest, weight_levels)
        deq = wq.astype(np.float64) * w_scale.astype(np.float64)
        # the float side: the float channels, the row's centre (carried by the float weights), for "minmax" the
        # value level 128 stands for (by the quantized ones), then 1 (the bias)
        carried = [rest.sum(axis=0)] if form.rows == "mean" else [rest.sum(axis=0), deq.sum(axis=0)]
        add = biases.get(node.output[0])  # the bias Add after this MatMul, folded into the float side
        bias = numpy_helper.to_array(inits[add.input[1]]) if add else np.zeros(weight.shape[1])
        side_w = np.concatenate([weight[idx].astype(np.float64), np.stack([*carried, bias])])
        output = add.output[0] if add else node.output[0]
        p = f"{node.name or node.output[0]}_int8"
        new_inits += [
            numpy_helper.from_array(wq, f"{p}_w"),
            numpy_helper.from_array(w_scale, f"{p}_w_scale"),
            numpy_helper.from_array(side_w.astype(np.float32), f"{p}_side_w"),
        ]
        q, scale, side = quantized_rows(node.input[0], idx, weight.shape[0])
        inputs = [q, scale, side, f"{p}_w", f"{p}_w_scale", f"{p}_side_w"]
        nodes.append(helper.make_node(QUANT_MATMUL, inputs, [output], domain=DOMAIN))
        replaced.add(w.name)
    read = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in new_inits if t.name in read])
    del graph.node[:]
    graph.node.extend(nodes)
    if replaced:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        model.functions.extend(int8_ops.functions(opset))
    return len(replaced)


def _bias_adds(graph: onnx.GraphProto, inits: Mapping[str, onnx.TensorProto]) -> dict[str, onnx.NodeProto]:
    """The bias Adds a rewrite folds into the float side: a MatMul's output -> the Add that is its one reader and
    adds a constant vector to it (each given a name if it had none)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = {}
    for i, node in enumerate(graph.node):
        after = readers.get(node.output[0], []) if node.op_type == "MatMul" else []
        add = after[0] if len(after) == 1 and node.output[0] not in outputs else None
        bias = inits.get(add.input[1]) if add is not None and add.op_type == "Add" else None
        if bias is not None and add.input[0] == node.output[0] and len(bias.dims) == 1:
            add.name = add.name or f"int8_bias_add_{i}"
            found[node.output[0]] = add
    return found


def input_peaks(encoder, inputs: list[tuple[np.ndarray, np.ndarray]], real_only: bool = True) -> dict:
    """Per weight product of ``encoder`` (by weight name), the largest |input| per channel over ``inputs`` ((x, mask)
    pairs, batch first), over real tokens only unless ``real_only`` is False. model/reference.py in float64."""
    from addnorm.model import reference

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
    torch weight holds is an error (the scheme would compute something else). A head's weight (``head.…``) is
    kept in float: None."""
    owners: dict[bytes, list[str]] = {}
    heads = [k for k, v in state.items() if k.startswith("head.") and np.ndim(v) == 2]
    for name in (*channels, *heads):
        for row in np.asarray(state[name], np.float32):
            owners.setdefault(row.tobytes(), []).append(name)

    def channels_of(weight: np.ndarray) -> np.ndarray | None:
        columns = [np.ascontiguousarray(weight[:, j], np.float32).tobytes() for j in range(weight.shape[1])]
        for name in dict.fromkeys(owners.get(columns[0], [])):  # equal rows in two weights: check them all
            if all(name in owners.get(c, ()) for c in columns):
                return None if name in heads else np.asarray(channels[name], np.int64)
        raise ValueError(f"a {list(weight.shape)} graph weight matches no weight of the encoder")

    return channels_of


def simulated(
    module=None, channels: Mapping[str, list[int]] | None = None, form: Form = DEFAULT_FORM
) -> Simulated:
    """Inside, every ``F.linear`` (the encoder's six weight products per layer) computes the int8 scheme of
    ``form`` exactly, in the dtype of its inputs (export.variants runs it in float64: what this variant can do at
    best); ``channels``: the float channels by weight name of ``module``'s parameters (a view of one, as q of
    in_proj, is found by its storage). model.schemes.Int8 is its numpy twin. It may be entered again (not
    nested): each weight is quantized once, at its first product (see ``Simulated``)."""
    return Simulated(module, channels, form)


class Simulated:
    """``simulated``'s context. Quantizing a weight (``Form.quantize``) costs more than the product it feeds: a
    gate evaluates the scheme on every case, so each weight's quantized form is kept, by the weight's storage,
    for as long as this object lives. Its weights are the module's, which the scheme's owner (export.gate: one
    per run) does not change; each weight kept is held, so no other tensor can take its memory and its key."""

    def __init__(
        self, module=None, channels: Mapping[str, list[int]] | None = None, form: Form = DEFAULT_FORM
    ):
        import torch

        self.form = form
        self.by_storage = {}
        if channels:
            self.by_storage = {
                t.untyped_storage().data_ptr(): torch.as_tensor(channels[name], dtype=torch.long)
                for name, t in module.state_dict().items()
                if name in channels
            }
        self.quantized: dict[tuple, tuple] = {}  # weight's place and dtype -> (weight, deq, colsums)
        self._linear = None

    def __enter__(self) -> None:
        import torch.nn.functional as F

        if self._linear is not None:
            raise RuntimeError("int8.simulated: already entered (it may be entered again, not nested)")
        self._linear = F.linear
        F.linear = self.linear

    def __exit__(self, *exc) -> None:
        import torch.nn.functional as F

        F.linear, self._linear = self._linear, None

    def rows_of(self, x, idx):  # model.schemes.Form.rows_of
        import torch

        if self.form.rows == "mean":
            centre = x.mean(-1, keepdim=True)
            dev = x - centre
            dev[..., idx] = 0.0
            reach = dev.abs().amax(-1, keepdim=True).clamp_min(TINY)
            levels = torch.round(dev * (HALF / reach)).clamp(
                -HALF, HALF
            )  # round half to even, as QuantizeLinear
            return levels, reach / HALF, torch.zeros_like(centre), centre
        keep = torch.ones(x.shape[-1], dtype=torch.bool)
        keep[idx] = False
        centre = x[..., keep].mean(-1, keepdim=True)
        dev = x - centre
        dev[..., idx] = 0.0
        lo = dev.amin(-1, keepdim=True)
        step = (dev.amax(-1, keepdim=True) - lo).clamp_min(TINY) / STEPS
        zero = torch.round(-(lo / step)).clamp(0, 255)
        levels = (torch.round(dev / step) + zero).clamp(0, 255) - ZERO_POINT
        levels[..., idx] = 0.0
        return levels, step, (ZERO_POINT - zero) * step, centre

    def dequantized(self, weight, idx, dtype):
        """(the weight as the graph multiplies it (E, N), its column sums, the float weights' column sums) in
        ``dtype``: computed at the weight's first product, then kept."""
        import torch

        key = (
            weight.untyped_storage().data_ptr(),
            weight.storage_offset(),
            tuple(weight.shape),
            tuple(weight.stride()),
            dtype,
        )
        kept = self.quantized.get(key)
        if kept is None:
            rest = weight.detach().T.double().numpy().copy()  # ONNX's (E, N)
            rest[idx.numpy()] = 0.0
            wq, w_scale = self.form.quantize(rest)
            deq = wq.astype(np.float64) * w_scale.astype(np.float64)
            arrays = (deq, deq.sum(axis=0), rest.sum(axis=0))
            kept = self.quantized[key] = (weight, *(torch.from_numpy(a).to(dtype) for a in arrays))
        return kept[1:]

    def linear(self, x, weight, bias=None):
        import torch

        idx = self.by_storage.get(weight.untyped_storage().data_ptr(), torch.zeros(0, dtype=torch.long))
        w_deq, base_w, centre_w = self.dequantized(weight, idx, x.dtype)
        levels, step, base, centre = self.rows_of(x, idx)
        y = (levels @ w_deq) * step + (
            base * base_w + centre * centre_w + x[..., idx] @ weight.T[idx].to(x.dtype)
        )
        return y if bias is None else y + bias
