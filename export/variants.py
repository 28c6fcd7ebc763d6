"""The variant registry: every graph variant of one encoder, by name, with how to build it, its parity gate and
the operators its graph must hold. A new variant is one ``Variant(...)`` entry here (and its test).

Every variant keeps float32 inputs and outputs, so clients and the service treat them alike.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from export.onnx_export import DEFAULT_OPSET, ExportError, export_onnx
from model.config import EncoderConfig
from model.encoder import Encoder
from model.verdict import Tolerance

# (encoder, path, opset, with_steps, attention form: export/attention.py)
Builder = Callable[[Encoder, Path, int, bool, str], onnx.ModelProto]


@dataclass(frozen=True)
class Variant:
    """``expected_ops(config)``: op type -> the exact count the graph must hold (export.checks enforces it)."""

    name: str
    summary: str
    precision: str  # what the weight GEMMs compute in: fp32, fp16 or int8
    tolerance: Tolerance  # the parity gate against torch fp32 on the same weights (docs/parity.md)
    build: Builder
    expected_ops: Callable[[EncoderConfig], dict[str, int]]


def norm_op(config: EncoderConfig) -> str:
    return "LayerNormalization" if config.norm == "layer" else "RMSNormalization"


def _norms(config: EncoderConfig) -> dict[str, int]:
    """One native norm per Add & Norm step (two per layer), plus the final norm of a pre-norm stack."""
    return {norm_op(config): config.num_norms}


def _export_fp32(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    return export_onnx(encoder, path, opset, with_steps, attention)


def _export_fp16(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    return export_onnx(copy.deepcopy(encoder).half(), path, opset, with_steps, attention)


def _export_int8(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    """Dynamic int8 quantization of the weight MatMuls (weights int8, activations quantized per run).

    The pre-processing step folds the q/k/v weight slices into constants, so those projections quantize too;
    MatMulConstBOnly keeps the activation x activation products of attention in float.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    export_onnx(encoder, path, opset, with_steps, attention)
    pre, out = path.with_suffix(".pre.onnx"), path.with_suffix(".int8.onnx")
    with _quiet():
        quant_pre_process(str(path), str(pre))
        quantize_dynamic(pre, out, weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})
    pre.unlink()
    model = onnx.load(str(out))
    out.unlink()
    _toposort(model.graph)
    onnx.save(model, str(path))
    return model


def _toposort(graph: onnx.GraphProto) -> None:
    """Order nodes so each follows the producers of every value it reads, those its If branches read from the
    enclosing graph included (the quantizer's own sort ignores those and places an If before its values)."""

    def reads(node: onnx.NodeProto) -> set[str]:
        names = set(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    names |= reads(inner)
        return names

    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    nodes = list(graph.node)
    deps = [{producer[n] for n in reads(node) if n in producer} - {i} for i, node in enumerate(nodes)]
    ordered: list[int] = []
    placed: set[int] = set()
    for root in range(len(nodes)):  # depth-first, iteratively: a deep stack of layers is a long chain
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                ordered.append(i)
            elif i not in placed:
                placed.add(i)
                stack.append((i, True))
                stack.extend((d, False) for d in sorted(deps[i], reverse=True) if d not in placed)
    del graph.node[:]
    graph.node.extend(nodes[i] for i in ordered)


def _export_fused(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    """onnxruntime's transformer optimizer: Add + LayerNormalization -> com.microsoft.SkipLayerNormalization."""
    from onnxruntime.transformers.optimizer import optimize_model

    cfg = encoder.config
    if cfg.norm != "layer":
        raise ExportError(
            "--optimize fused needs LayerNorm: onnxruntime has no SkipRMSNorm fusion for this graph"
        )
    export_onnx(encoder, path, opset, with_steps, attention)
    with _quiet():
        # opt_level 0: only the graph fusions, no onnxruntime session-level rewrites baked into the file.
        optimized = optimize_model(
            str(path), model_type="bert", num_heads=cfg.nhead, hidden_size=cfg.d_model, opt_level=0
        )
        optimized.save_model_to_file(str(path))
    return onnx.load(str(path))


def _fused_ops(config: EncoderConfig) -> dict[str, int]:
    # Every residual add followed by a norm fuses; a pre-norm stack's first norm has no add before it.
    return {"SkipLayerNormalization": 2 * config.num_layers, "LayerNormalization": int(config.norm_first)}


# fp16 computes in half precision with LayerNorm statistics in float32 (stash_type 1). int8 quantizes the
# weights and, per run and per tensor, the activations of every weight MatMul: on random weights its worst case
# (few tokens) reaches a relative RMS error of 0.10 at d_model 768 and 0.21 at 64, so its gate catches broken
# graphs (wrong weights give ~1.4), not the last digits.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("fp32", "the reference graph", "fp32", Tolerance(), _export_fp32, _norms),
        Variant(
            "fp16",
            "weights and compute in half precision, LayerNorm statistics in fp32",
            "fp16",
            Tolerance(atol=2e-2, rtol=1e-2, oracle_factor=0.0),
            _export_fp16,
            _norms,
        ),
        Variant(
            "int8",
            "dynamic int8 quantization of the 6 weight MatMuls per layer",
            "int8",
            Tolerance(atol=1.0, rtol=0.0, oracle_factor=0.0, rel_rms=0.3),
            _export_int8,
            lambda c: {**_norms(c), "MatMulInteger": 6 * c.num_layers},
        ),
        Variant(
            "fused",
            "Add + LayerNormalization fused into com.microsoft.SkipLayerNormalization",
            "fp32",
            Tolerance(),
            _export_fused,
            _fused_ops,
        ),
    )
}


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ExportError(f"unknown variant {name!r}; choose one of {sorted(VARIANTS)}") from None


def build_graph(
    encoder: Encoder,
    path: str | Path,
    variant: str = "fp32",
    opset: int = DEFAULT_OPSET,
    with_steps: bool = False,
    attention: str = "decomposed",
) -> onnx.ModelProto:
    """Export ``encoder`` as ``variant`` with ``attention`` (a form of export/attention.py) into ``path``."""
    return get_variant(variant).build(encoder, Path(path), opset, with_steps, attention)


@contextlib.contextmanager
def _quiet():
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        root.setLevel(level)
