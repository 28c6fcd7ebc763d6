"""Structural checks on an exported graph. Each failure names the rule it broke."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import onnx

from addnorm.export import attention as attn
from addnorm.export.onnx_export import MIN_OPSET, opset_of
from addnorm.export.variants import get_variant, norm_op
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import EMBEDDINGS, MASK, input_names, output_names

# ONNX elem types the artifact allows for embeddings/encoded (fp16 artifacts take fp16 or fp32).
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
_DECOMPOSED_NORM_OPS = ("ReduceMean",)  # a LayerNorm spelled out op by op leaves these behind


class GraphCheckError(AssertionError):
    """The exported graph breaks a rule of the artifact format."""


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    """Nodes by op type, those inside If branches (and other subgraphs) included, and a model-local function's
    call counted with its body's nodes (int8's RowQuantize and QuantMatMul: export/int8_ops.py)."""
    functions = {(f.domain, f.name): f.node for f in model.functions}

    def walk(nodes) -> Iterator[str]:
        for node in nodes:
            yield node.op_type
            yield from walk(functions.get((node.domain, node.op_type), ()))
            for a in node.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from walk(sub.node)

    return Counter(walk(model.graph.node))


def check_graph(
    model: onnx.ModelProto, config: EncoderConfig, variant: str = "fp32", attention: str = "decomposed"
) -> dict[str, int]:
    """Validate the graph against the artifact rules, the variant's expected operators and the attention form's
    (export/attention.py); return the op counts that matter (norm nodes, fused nodes, attention nodes, all)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise GraphCheckError(f"onnx.checker rejected the graph: {exc}") from exc
    opset = opset_of(model)
    if opset < MIN_OPSET:
        raise GraphCheckError(
            f"graph opset is {opset}; the artifact needs >= {MIN_OPSET} for LayerNormalization"
        )
    counts = op_counts(model)
    norm = norm_op(config)
    expected_ops = {**get_variant(variant).expected_ops(config), **attn.expected_ops(attention, config)}
    # a variant may declare its own uses of these (int8's row means); anything beyond is a spelled-out norm
    decomposed = {op: counts[op] for op in _DECOMPOSED_NORM_OPS if counts[op] > expected_ops.get(op, 0)}
    if decomposed:
        raise GraphCheckError(
            f"graph holds a decomposed normalization ({decomposed}); expected native {norm} only"
        )
    for op, expected in expected_ops.items():
        if counts[op] != expected:
            final = (" + 1 final norm" if config.norm_first else "") + (
                " + the sparse head's norm" if config.head == "sparse" else ""
            )
            why = f" ({config.num_layers} layer(s) x 2 Add & Norm steps{final})" if op == norm else ""
            raise GraphCheckError(
                f"{variant} variant, {attention} attention: expected {expected} {op} node(s){why}, found "
                f"{counts[op]}; "
                f"op counts: {dict(counts)}"
            )
    _check_io(model, config)
    return {
        "norm_nodes": counts[norm],
        "fused_nodes": counts["SkipLayerNormalization"],
        "attention_nodes": counts["MultiHeadAttention"] + counts["Attention"] + counts["Softmax"],
        "nodes": sum(counts.values()),
    }


def _check_io(model: onnx.ModelProto, config: EncoderConfig) -> None:
    inputs = {i.name: i for i in model.graph.input}
    missing = [n for n in input_names(config) if n not in inputs]
    if missing:
        raise GraphCheckError(f"graph inputs {sorted(inputs)} lack {missing}")
    emb = inputs[EMBEDDINGS].type.tensor_type
    if emb.elem_type not in _FLOAT_TYPES:
        raise GraphCheckError(
            f"input {EMBEDDINGS!r} has elem type {emb.elem_type}, expected float32 or float16"
        )
    if inputs[MASK].type.tensor_type.elem_type != onnx.TensorProto.BOOL:
        raise GraphCheckError(f"input {MASK!r} must be bool")
    dims = emb.shape.dim
    if config.packed:  # every input flat and of any length (model.contract)
        for name in input_names(config):
            shape = inputs[name].type.tensor_type.shape.dim
            if len(shape) != 1 or shape[0].HasField("dim_value"):
                raise GraphCheckError(f"packed graph input {name!r} must be rank 1 of symbolic length")
    elif len(dims) != 3:
        raise GraphCheckError(f"input {EMBEDDINGS!r} must be rank 3, is rank {len(dims)}")
    fixed = [] if config.packed else [i for i in (0, 1) if dims[i].HasField("dim_value")]
    if fixed:
        raise GraphCheckError(
            f"embeddings dim(s) {fixed} were specialized to fixed sizes; batch and sequence must be symbolic"
        )
    expected = list(output_names(config))
    outputs = [o.name for o in model.graph.output][: len(expected)]
    if outputs != expected:
        raise GraphCheckError(f"graph outputs begin with {outputs}, expected {expected}")
