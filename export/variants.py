"""Graph variants of one encoder: fp32 (the reference), fp16, int8 (dynamic quantization), fused (SkipLayerNorm).

Every variant keeps float32 inputs and outputs, so clients and the service treat them alike; each has its own
parity tolerance (export.parity.VARIANT_TOLERANCES).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from pathlib import Path

import onnx

from export.onnx_export import DEFAULT_OPSET, ExportError, export_onnx
from model.artifact import VARIANTS
from model.encoder import Encoder


def build_graph(
    encoder: Encoder,
    path: str | Path,
    variant: str = "fp32",
    opset: int = DEFAULT_OPSET,
    with_steps: bool = False,
) -> onnx.ModelProto:
    """Export ``encoder`` as ``variant`` into ``path`` and return the model written there."""
    if variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    path = Path(path)
    if variant == "fp16":
        return export_onnx(copy.deepcopy(encoder).half(), path, opset, with_steps)
    model = export_onnx(encoder, path, opset, with_steps)
    if variant == "int8":
        return _quantize_int8(path)
    if variant == "fused":
        return _fuse(path, encoder)
    return model


def _quantize_int8(path: Path) -> onnx.ModelProto:
    """Dynamic int8 quantization of the weight MatMuls (weights int8, activations quantized per run).

    The pre-processing step folds the q/k/v weight slices into constants, so those projections quantize too;
    MatMulConstBOnly keeps the activation x activation products of attention in float.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre, out = path.with_suffix(".pre.onnx"), path.with_suffix(".int8.onnx")
    with _quiet():
        quant_pre_process(str(path), str(pre))
        quantize_dynamic(pre, out, weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})
    pre.unlink()
    out.replace(path)
    return onnx.load(str(path))


def _fuse(path: Path, encoder: Encoder) -> onnx.ModelProto:
    """onnxruntime's transformer optimizer: Add + LayerNormalization -> com.microsoft.SkipLayerNormalization."""
    from onnxruntime.transformers.optimizer import optimize_model

    cfg = encoder.config
    if cfg.norm != "layer":
        raise ExportError(
            "--optimize fused needs LayerNorm: onnxruntime has no SkipRMSNorm fusion for this graph"
        )
    with _quiet():
        # opt_level 0: only the graph fusions, no onnxruntime session-level rewrites baked into the file.
        optimized = optimize_model(
            str(path), model_type="bert", num_heads=cfg.nhead, hidden_size=cfg.d_model, opt_level=0
        )
        optimized.save_model_to_file(str(path))
    return onnx.load(str(path))


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
