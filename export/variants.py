"""The variant registry: every graph variant of one encoder, by name, with how to build it, its parity gate and
the operators its graph must hold. A new variant is one ``Variant(...)`` entry here (and its test).

Every variant keeps float32 inputs and outputs, so clients and the service treat them alike.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from addnorm.export import int8, traces
from addnorm.export.onnx_export import DEFAULT_OPSET, ExportError, export_onnx
from addnorm.export.yardsticks import SchemeModel, torch_outputs
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import Encoder
from addnorm.model.schemes import FLOAT_CHANNELS_KEY, Form
from addnorm.model.verdict import Tolerance

# (encoder, path, opset, with_steps, attention form: export/attention.py); a variant with a plan takes it as plan=
Builder = Callable[..., onnx.ModelProto]
# (encoder, embeddings, mask, with_steps) -> outputs, as export.parity.torch_outputs returns them (plan= too)
Scheme = Callable[..., dict[str, np.ndarray]]
# (encoder, representative inputs as (x, mask) pairs) -> the scheme's parameters, kept as the manifest's "scheme"
Planner = Callable[[Encoder, list[tuple[np.ndarray, np.ndarray]]], dict]


@dataclass(frozen=True)
class Variant:
    """``expected_ops(config)``: op type -> the exact count the graph must hold (export.checks enforces it).

    ``scheme``: for a lossy variant, its own arithmetic computed by torch, (encoder, x, mask, with_steps) ->
    outputs (export.parity.torch_outputs' form); the gate lets the graph be as far from float64 as that is.
    ``plan``: a variant whose scheme has parameters chosen on representative inputs (int8's float channels) plans
    them once per export; ``build`` and ``scheme`` then take them as ``plan=``, and the manifest keeps them.
    """

    name: str
    summary: str
    precision: str  # what the weight GEMMs compute in: fp32, fp16 or int8
    tolerance: Tolerance  # the parity gate against torch fp32 on the same weights (docs/parity.md)
    build: Builder
    expected_ops: Callable[[EncoderConfig], dict[str, int]]
    scheme: Scheme | None = None
    plan: Planner | None = None
    scheme_model: SchemeModel | None = None  # the scheme as a module, for its steps (export.yardsticks)

    def for_run(self, plan: dict | None) -> tuple[Scheme | None, SchemeModel | None]:
        """(scheme, scheme_model) for one gate run with ``plan``: the scheme's module is built at the run's first
        case and kept for the run (its encoder does not change within one), not rebuilt for every case and
        one-ulp move; int8's weights are then quantized once a run (export.int8.Simulated)."""
        if self.scheme_model is None:
            return (functools.partial(self.scheme, plan=plan) if self.scheme and plan else self.scheme), None
        build, built, run_plan = self.scheme_model, {}, plan

        def model(encoder: Encoder, plan: dict | None = plan) -> tuple:
            if plan is not run_plan:  # not this run's plan: built for the call, nothing kept
                return build(encoder, plan)
            if encoder not in built:
                built[encoder] = build(encoder, plan)
            return built[encoder]

        return functools.partial(_scheme_of(model), plan=plan), model

    @property
    def input_precision(self) -> type:
        """What the scheme rounds its input to: its spread is measured one ulp of it away (export.parity)."""
        return np.float16 if self.precision == "fp16" else np.float32


def norm_op(config: EncoderConfig) -> str:
    return "LayerNormalization" if config.norm == "layer" else "RMSNormalization"


def _norms(config: EncoderConfig) -> dict[str, int]:
    """One native norm per Add & Norm step (two per layer), plus the final norm of a pre-norm stack."""
    return {norm_op(config): config.norm_nodes}


def _export_fp32(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    return export_onnx(encoder, path, opset, with_steps, attention)


def _export_fp16(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str
) -> onnx.ModelProto:
    return export_onnx(copy.deepcopy(encoder).half(), path, opset, with_steps, attention)


def _export_int8(
    encoder: Encoder, path: Path, opset: int, with_steps: bool, attention: str, plan: dict | None = None
) -> onnx.ModelProto:
    """int8 weight MatMuls with activations quantized per row, the plan's float channels in float
    (export/int8.py says why this scheme).

    onnxruntime's pre-processing folds the q/k/v weight slices into constants first, so those projections
    quantize too; the activation x activation products of attention stay in float.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    export_onnx(encoder, path, opset, with_steps, attention)
    pre = path.with_suffix(".pre.onnx")
    with _quiet():
        # Only its folding is needed. onnxruntime's symbolic shape inference reads ONNX's own Attention (opset 23)
        # as com.microsoft.Attention and fails on it.
        quant_pre_process(str(path), str(pre), skip_symbolic_shape=True)
    model = onnx.load(str(pre))
    pre.unlink()
    channels = (plan or {}).get(FLOAT_CHANNELS_KEY)
    state = {k: v.detach().float().numpy() for k, v in encoder.state_dict().items()}
    try:
        int8.quantize_graph(model, int8.owner_channels(state, channels) if channels else None, _form(plan))
    except ValueError as exc:
        raise ExportError(f"int8: {exc}") from None
    _toposort(model.graph)
    onnx.save(model, str(path))
    return model


def _fp16_model(encoder: Encoder, plan: dict | None = None):
    """torch in half precision: what fp16 arithmetic itself gives (a pre-norm stack's residual stream, say)."""
    return copy.deepcopy(encoder).half(), torch.float16, contextlib.nullcontext()


def _int8_model(encoder: Encoder, plan: dict | None = None):
    """export/int8.py's arithmetic, exactly (float64)."""
    double = copy.deepcopy(encoder).double()
    return double, torch.float64, int8.simulated(double, (plan or {}).get(FLOAT_CHANNELS_KEY), _form(plan))


def _scheme_of(model: SchemeModel) -> Scheme:
    """A scheme model's outputs on whole inputs, float64."""

    def scheme(encoder, x, mask, with_steps, plan=None) -> dict[str, np.ndarray]:
        module, dtype, context = model(encoder, plan)
        with context:
            outs = torch_outputs(module, torch.from_numpy(x).to(dtype).numpy(), mask, with_steps)
        return {k: o.astype(np.float64) for k, o in outs.items()}

    return scheme


def _form(plan: dict | None) -> Form:
    """The int8 form a plan names; without a plan (a graph built outside an export), the default form. A plan
    that names none is an artifact of the first form (model.schemes.Form.of)."""
    return Form() if plan is None else Form.of(plan)


def _int8_plan(encoder: Encoder, inputs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """int8's form and its float channels, chosen on representative inputs (export/int8.py)."""
    return {**Form().to_plan(), FLOAT_CHANNELS_KEY: int8.float_channels(encoder, inputs)}


def _toposort(graph: onnx.GraphProto) -> None:
    """Order nodes so each follows the producers of every value it reads, those its If branches read from the
    enclosing graph included (onnxruntime's pre-processing and transformer optimizer sort without those and
    place an If before its values)."""

    # "" marks an absent optional input or output, never a value
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    nodes = list(graph.node)
    deps = [{producer[n] for n in traces.reads(node) if n in producer} - {i} for i, node in enumerate(nodes)]
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
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    cfg = encoder.config
    if cfg.norm != "layer":
        raise ExportError(
            "--optimize fused needs LayerNorm: onnxruntime has no SkipRMSNorm fusion for this graph"
        )
    if attention == "onnx":
        raise ExportError(
            "--optimize fused cannot fuse a graph with ONNX's Attention operator: onnxruntime's transformer "
            "optimizer reads it as com.microsoft.Attention, its shape inference fails and no Add + "
            "LayerNormalization is fused; use --attention mha (the default) or decomposed"
        )
    export_onnx(encoder, path, opset, with_steps, attention)
    if (
        not cfg.bias
    ):  # the optimizer's SkipLayerNormalization fusion reads a bias input: give it zeros (exact)
        _zero_norm_biases(path)
    options = FusionOptions("bert")
    # the norms' fusion alone: an mha graph's Gelu stays as the form spells it (export/attention.py), for the session
    # to fuse with its bias at load as it does every mha graph's
    options.enable_bias_gelu = False
    with _quiet():
        # opt_level 0: only the graph fusions, no onnxruntime session-level rewrites baked into the file.
        optimized = optimize_model(
            str(path),
            model_type="bert",
            num_heads=cfg.nhead,
            hidden_size=cfg.d_model,
            opt_level=0,
            optimization_options=options,
        )
        optimized.save_model_to_file(str(path))  # adds the com.microsoft opset import its fused nodes need
    model = onnx.load(str(path))
    _toposort(model.graph)
    onnx.save(model, str(path))
    return model


def _zero_norm_biases(path: Path) -> None:
    """Each LayerNormalization without its bias input (a bias-free block's) in the graph at ``path`` given a
    bias of zeros: the same results, in the form onnxruntime's transformer optimizer fuses."""
    model = onnx.load(str(path))
    for i, node in enumerate(model.graph.node):
        if node.op_type == "LayerNormalization" and (len(node.input) < 3 or not node.input[2]):
            scale = next(t for t in model.graph.initializer if t.name == node.input[1])
            name = f"zero_norm_bias_{i}"
            model.graph.initializer.append(
                onnx.numpy_helper.from_array(np.zeros(scale.dims, np.float32), name)
            )
            del node.input[2:]
            node.input.append(name)
    onnx.save(model, str(path))


def _int8_ops(config: EncoderConfig) -> dict[str, int]:
    # Per layer: 6 weight MatMuls reading 4 distinct activations (q, k and v share theirs), each quantized once
    # (today's form: two QuantizeLinear per activation, its rows' zero points and its levels): one RowQuantize per
    # activation and one QuantMatMul per product, counted with their function bodies (export/int8_ops.py).
    layers = config.num_layers
    return {
        **_norms(config),
        **{"RowQuantize": 4 * layers, "QuantMatMul": 6 * layers},
        **{"MatMulInteger": 6 * layers, "QuantizeLinear": 8 * layers},
    }


def _fused_ops(config: EncoderConfig) -> dict[str, int]:
    # Every residual add followed by a norm fuses; a pre-norm stack's first norm has no add before it.
    return {
        "SkipLayerNormalization": 2 * config.num_layers,
        # a pre-norm stack's first norm reads the input, no Add to fuse (none without a first attention norm)
        "LayerNormalization": int(config.norm_first and config.first_attention_norm) + config.head_norms,
    }


# fp16 computes in half precision with LayerNorm statistics in float32 (stash_type 1). Both are lossy: judged
# per row, for quality against torch fp32 on representative inputs and for implementation against their scheme
# (model.verdict), with no float64 rescue (oracle_factor 0). int8's quality bounds were measured on a real trained
# model (all-MiniLM-L6-v2, real sentences; docs/parity.md, "int8 on the real model"): what a retrieval user needs,
# each sentence embedding within cosine 0.999 of fp32, and token rows bounded at about twice their spread there
# (worst 6% relative RMS, least cosine 0.9987, worst element 0.24 x its row's RMS). The first int8 scheme (0.9985
# per sentence, token rows to 11% and cosine 0.9947) fails them. A graph that does not compute its scheme (a
# LayerNorm gamma off by 5% on the seeded block) fails the implementation verdict.
FP16_TOLERANCE = Tolerance(
    atol=None, rtol=0.0, oracle_factor=0.0, row_rel_rms=0.01, row_cosine=0.9999, row_peak=0.05
)
INT8_TOLERANCE = Tolerance(
    atol=None,
    rtol=0.0,
    oracle_factor=0.0,
    row_rel_rms=0.15,
    row_cosine=0.995,
    row_peak=0.5,
    sentence_cosine=0.999,
)
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("fp32", "the reference graph", "fp32", Tolerance(), _export_fp32, _norms),
        Variant(
            "fp16",
            "weights and compute in half precision, LayerNorm statistics in fp32",
            "fp16",
            FP16_TOLERANCE,
            _export_fp16,
            _norms,
            _scheme_of(_fp16_model),
            scheme_model=_fp16_model,
        ),
        Variant(
            "int8",
            "int8 weights and per-row int8 activations in the 6 weight MatMuls per layer",
            "int8",
            INT8_TOLERANCE,
            _export_int8,
            _int8_ops,
            _scheme_of(_int8_model),
            _int8_plan,
            _int8_model,
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
    plan: dict | None = None,
) -> onnx.ModelProto:
    """Export ``encoder`` as ``variant`` with ``attention`` (a form of export/attention.py) into ``path``;
    ``plan``: the variant's scheme parameters (``Variant.plan``), for a variant that has them."""
    v = get_variant(variant)
    if plan and v.plan is not None:
        return v.build(encoder, Path(path), opset, with_steps, attention, plan=plan)
    return v.build(encoder, Path(path), opset, with_steps, attention)


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
