"""Structural checks on an exported graph. Each failure names the rule it broke."""

from __future__ import annotations

from collections import Counter

import onnx

from export.onnx_export import INPUT_NAMES, MIN_OPSET, OUTPUT_NAME, opset_of
from model.config import EncoderConfig

# ONNX elem types the artifact allows for embeddings/encoded (fp16 artifacts take fp16 or fp32).
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
_DECOMPOSED_NORM_OPS = ("ReduceMean",)  # a LayerNorm spelled out op by op leaves these behind


class GraphCheckError(AssertionError):
    """The exported graph breaks a rule of the artifact format."""


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


def norm_op(config: EncoderConfig) -> str:
    return "LayerNormalization" if config.norm == "layer" else "RMSNormalization"


def check_graph(model: onnx.ModelProto, config: EncoderConfig, fused: bool = False) -> dict[str, int]:
    """Validate the graph; return the op counts that matter (norm nodes, fused nodes)."""
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
    expected = config.num_norms
    if fused:
        # Each post-/pre-norm Add & Norm step becomes one SkipLayerNormalization; any plain norm left stays.
        found = counts["SkipLayerNormalization"] + counts[norm]
        fused_count = counts["SkipLayerNormalization"]
        if fused_count == 0:
            raise GraphCheckError("fused variant: no com.microsoft.SkipLayerNormalization node in the graph")
    else:
        found = counts[norm]
        fused_count = 0
    if found != expected:
        raise GraphCheckError(
            f"expected {expected} {norm} node(s) ({config.num_layers} layer(s) x 2 Add & Norm steps"
            f"{' + 1 final norm' if config.norm_first else ''}), found {found}; op counts: {dict(counts)}"
        )
    decomposed = {op: counts[op] for op in _DECOMPOSED_NORM_OPS if counts[op]}
    if decomposed:
        raise GraphCheckError(
            f"graph holds a decomposed normalization ({decomposed}); expected native {norm} only"
        )

    _check_io(model)
    return {"norm_nodes": counts[norm], "fused_nodes": fused_count, "nodes": sum(counts.values())}


def _check_io(model: onnx.ModelProto) -> None:
    inputs = {i.name: i for i in model.graph.input}
    missing = [n for n in INPUT_NAMES if n not in inputs]
    if missing:
        raise GraphCheckError(f"graph inputs {sorted(inputs)} lack {missing}")
    emb = inputs["embeddings"].type.tensor_type
    if emb.elem_type not in _FLOAT_TYPES:
        raise GraphCheckError(
            f"input 'embeddings' has elem type {emb.elem_type}, expected float32 or float16"
        )
    if inputs["mask"].type.tensor_type.elem_type != onnx.TensorProto.BOOL:
        raise GraphCheckError("input 'mask' must be bool")
    dims = emb.shape.dim
    if len(dims) != 3:
        raise GraphCheckError(f"input 'embeddings' must be rank 3, is rank {len(dims)}")
    fixed = [i for i in (0, 1) if dims[i].HasField("dim_value")]
    if fixed:
        raise GraphCheckError(
            f"embeddings dim(s) {fixed} were specialized to fixed sizes; batch and sequence must be symbolic"
        )
    if model.graph.output[0].name != OUTPUT_NAME:
        raise GraphCheckError(
            f"first graph output is {model.graph.output[0].name!r}, expected {OUTPUT_NAME!r}"
        )
