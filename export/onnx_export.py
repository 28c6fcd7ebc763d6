"""torch Encoder -> self-contained model.onnx with symbolic batch and sequence dims."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor, nn

from addnorm.export import attention as attn
from addnorm.export import traces
from addnorm.model.contract import (
    BATCH,
    ELEMENTS,
    LONGEST_ELEMENTS,
    SEQ,
    STARTS,
    STEP_OUTPUT,
    TOKENS,
    input_names,
)
from addnorm.model.contract import output_names as contract_outputs
from addnorm.model.encoder import Encoder, Packing

MIN_OPSET = 17  # LayerNormalization entered the standard in opset 17
RMS_MIN_OPSET = 23  # RMSNormalization entered the standard in opset 23
DEFAULT_OPSET = 17
# Example sizes for tracing. Both must be >= 2: a dim traced at size 1 is specialized to 1 by torch.export.
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 5


class ExportError(RuntimeError):
    """The exporter failed, or produced a graph that breaks a rule of the artifact format."""


class _GraphModule(nn.Module):
    """What is traced: (embeddings, mask) -> every output of the contract in its order, plus every Add & Norm
    result when ``with_steps``.

    Inputs and outputs stay float32 whatever the encoder's dtype: an fp16 graph casts at its edges.
    """

    def __init__(self, encoder: Encoder, with_steps: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.with_steps = with_steps
        self.dtype = next(encoder.parameters()).dtype

    def forward(self, embeddings: Tensor, mask: Tensor) -> Tensor | tuple[Tensor, ...]:
        steps: list[Tensor] | None = [] if self.with_steps else None
        return self.graph_outputs(self.encoder.outputs(embeddings.to(self.dtype), mask, steps), steps)

    def graph_outputs(
        self, named: dict[str, Tensor], steps: list[Tensor] | None
    ) -> Tensor | tuple[Tensor, ...]:
        """The contract's outputs in graph order, then every Add & Norm result, float32."""
        outs = tuple(
            t.float()
            for t in (*(named[name] for name in contract_outputs(self.encoder.config)), *(steps or []))
        )
        return outs[0] if len(outs) == 1 else outs


class _PackedGraphModule(_GraphModule):
    """What is traced for a packed graph (model.contract, model/packing.py): (embeddings (T x E,), mask (T,),
    offsets (B + 1,), longest (S x E,)) -> the same outputs as a padded graph's, (B, S, ...)."""

    def forward(  # type: ignore[override]
        self, embeddings: Tensor, mask: Tensor, offsets: Tensor, longest: Tensor
    ) -> Tensor | tuple[Tensor, ...]:
        width = self.encoder.config.d_model
        # (1, T, E): the token axis where a batch's is, so every weight product stays a MatMul over (rows, E)
        tokens = embeddings.reshape(1, -1, width).to(self.dtype)
        bounds = offsets.to(torch.int64) // width
        # max(1, ...): a padded length the tracer can prove positive (torch.cond refuses strides holding Max(1, seq))
        seq = torch.sym_max(longest.shape[0] // width, 1)
        packing = Packing(bounds[:-1], bounds[1:] - bounds[:-1], seq, mask)
        steps: list[Tensor] | None = [] if self.with_steps else None
        return self.graph_outputs(self.encoder.packed_outputs(tokens, packing, steps), steps)


def output_names(encoder: Encoder, with_steps: bool) -> list[str]:
    names = list(contract_outputs(encoder.config))
    if with_steps:
        names += [STEP_OUTPUT.format(i) for i in range(encoder.config.num_norms)]
    return names


def export_onnx(
    encoder: Encoder,
    path: str | Path,
    opset: int = DEFAULT_OPSET,
    with_steps: bool = False,
    attention: str = "decomposed",
) -> onnx.ModelProto:
    """Export ``encoder`` (eval mode, any float dtype) to one self-contained ONNX file with float32 I/O, its
    attention spelled as ``attention`` (``auto``, ``mha``, ``onnx`` or ``decomposed``: export/attention.py)."""
    cfg = encoder.config
    try:
        form = attn.resolve(attention, opset)
    except attn.AttentionError as exc:
        raise ExportError(str(exc)) from None
    if opset < MIN_OPSET:
        raise ExportError(
            f"opset {opset} has no LayerNormalization operator; use --opset {MIN_OPSET} or newer"
        )
    if cfg.norm == "rms" and opset < RMS_MIN_OPSET:
        raise ExportError(
            f"--norm rms exports as ONNX RMSNormalization, which needs opset {RMS_MIN_OPSET}; at opset {opset} the "
            f"exporter would spell it out op by op. Use --opset {RMS_MIN_OPSET}"
        )
    traced = traces.cache()
    if traced is None:  # outside export.traces.reusing(): trace what was asked
        _trace(encoder, Path(path), opset, with_steps, form)
        return load_checked(path, opset)
    key = traces.key(encoder.eval(), opset, form, str(next(encoder.parameters()).dtype))
    if key not in traced:  # trace with the step outputs once; the served graph is that trace without them
        _trace(encoder, Path(path), opset, True, form)
        traced[key] = Path(path).read_bytes()
    model = onnx.ModelProto.FromString(traced[key])
    if not with_steps:
        model = traces.without_steps(model, output_names(encoder, False))
    onnx.save(model, str(path))
    return load_checked(path, opset)


def _trace(encoder: Encoder, path: Path, opset: int, with_steps: bool, form: str) -> None:
    """torch.onnx.export of ``encoder``'s graph module (padded or packed) into ``path``."""
    cfg = encoder.config
    if cfg.packed:
        args, dims = _packed_example(cfg.d_model)
        module: nn.Module = _PackedGraphModule(encoder.eval(), with_steps)
    else:
        args, dims = _padded_example(cfg.d_model, cfg.batch_first)
        module = _GraphModule(encoder.eval(), with_steps)
    names = (list(input_names(cfg)), output_names(encoder, with_steps))
    with attn.spelled(encoder, form):
        export_module(module, args, path, names, dims, opset, attn.TRANSLATIONS)


def _padded_example(width: int, batch_first: bool) -> tuple[tuple[Tensor, ...], tuple[dict, ...]]:
    """A padded graph's example inputs (embeddings, mask) and their symbolic batch and sequence dims."""
    batch, seq = torch.export.Dim(BATCH), torch.export.Dim(SEQ)
    if batch_first:
        example = torch.randn(EXAMPLE_BATCH, EXAMPLE_SEQ, width)
        emb_dims = {0: batch, 1: seq}
    else:
        example = torch.randn(EXAMPLE_SEQ, EXAMPLE_BATCH, width)
        emb_dims = {0: seq, 1: batch}
    mask = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQ, dtype=torch.bool)
    return (example, mask), (emb_dims, {0: batch, 1: seq})


def _packed_example(width: int) -> tuple[tuple[Tensor, ...], tuple[dict, ...]]:
    """A packed graph's example inputs (sequences of 5 and 2 tokens: every size distinct, none 1) and dims."""
    lengths = (EXAMPLE_SEQ, 2)
    tokens = sum(lengths)
    offsets = torch.tensor([0, lengths[0] * width, tokens * width], dtype=torch.int32)
    args = (
        torch.randn(tokens * width),
        torch.zeros(tokens, dtype=torch.bool),
        offsets,
        torch.zeros(EXAMPLE_SEQ * width, dtype=torch.int32),
    )
    dims = tuple({0: torch.export.Dim(name)} for name in (ELEMENTS, TOKENS, STARTS, LONGEST_ELEMENTS))
    return args, dims


def export_module(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    names: tuple[list[str], list[str]],
    dynamic_shapes: object,
    opset: int,
    translations: dict | None = None,
) -> None:
    """torch.onnx.export (dynamo) of ``module`` into one self-contained file; ``names``: (inputs, outputs)."""
    log = io.StringIO()
    try:
        # The exporter prints progress and warns about unrelated operator libraries; keep it for errors only.
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
            _quiet_loggers(),
            torch.no_grad(),
            _torchlib_once(),
        ):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                input_names=names[0],
                output_names=names[1],
                dynamic_shapes=dynamic_shapes,
                opset_version=opset,
                custom_translation_table=translations,
                optimize=True,
                verbose=False,
            )
            program.save(path, external_data=False)
    except Exception as exc:  # the exporter raises many types; all mean the same thing to the user
        raise ExportError(
            f"torch.onnx.export failed: {type(exc).__name__}: {exc}\n{log.getvalue()[-4000:]}"
        ) from exc


# Each torch.onnx.export call builds its registry of ATen -> ONNX functions anew from onnxscript's torchlib, parsing the
# source of ~500 functions (0.5-1 s of a one-layer block's 2-3 s export on a 2-core Xeon): an export traces the block
# and, for a text model, its embedding layer, and a process exporting several models repeats it each time. Built once
# per process and opset (by its arguments); each call gets its own copy of the lists, which its custom translations
# extend. _TORCHLIB_BUILD: torch's own ``from_torchlib``, as found before the first export replaced it.
_TORCHLIB: dict[tuple, Any] = {}
_TORCHLIB_BUILD: dict[str, Any] = {}


@contextlib.contextmanager
def _torchlib_once() -> Iterator[None]:
    """Within the block, torch.onnx.export's registry is this process's copy for its opset (see _TORCHLIB). The
    exporter's registry is internal to torch (pinned by the export extra): where it is not found, nothing changes."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry as registry
    except ImportError:
        yield
        return
    own = _TORCHLIB_BUILD.setdefault("from_torchlib", vars(registry).get("from_torchlib"))
    if not isinstance(own, classmethod):
        yield
        return

    def from_torchlib(cls, *args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _TORCHLIB:
            _TORCHLIB[key] = own.__func__(cls, *args, **kwargs)
        built = _TORCHLIB[key]
        copy = cls()
        copy._opset_version = built._opset_version
        copy.functions = {target: list(decomps) for target, decomps in built.functions.items()}
        return copy

    registry.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        registry.from_torchlib = own


def load_checked(path: str | Path, opset: int) -> onnx.ModelProto:
    model = onnx.load(str(path))
    actual = opset_of(model)
    if actual != opset:
        raise ExportError(
            f"asked for opset {opset} but the exporter wrote opset {actual} "
            "(the version converter could not convert the graph); choose another --opset"
        )
    return model


def opset_of(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


@contextlib.contextmanager
def _quiet_loggers():
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
