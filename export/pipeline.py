"""Export an encoder into an artifact directory, gated by graph checks and parity."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import platform
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from addnorm.export import traces
from addnorm.export.attention import AttentionError
from addnorm.export.attention import resolve as resolve_attention
from addnorm.export.cases import Case, default_cases, synthetic
from addnorm.export.checks import check_graph
from addnorm.export.embedding import TextExport, export_embedding, gate_embedding, write_embedding_golden
from addnorm.export.families import Family
from addnorm.export.families.bert import FAMILY as BERT
from addnorm.export.gate import ParityError, gate
from addnorm.export.golden import golden_cases, write_golden
from addnorm.export.onnx_export import DEFAULT_OPSET, ExportError
from addnorm.export.parity import ParityReport
from addnorm.export.publish import publish, staging_for
from addnorm.export.quantized import calibrated, write_calibration
from addnorm.export.variants import build_graph, get_variant
from addnorm.export.weights import load_state, read_state_dict, save_weights
from addnorm.model.artifact import GOLDEN_FILE, MANIFEST_FILE, MODEL_FILE, WEIGHTS_FILE, Manifest, sha256_file
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import io_specs
from addnorm.model.encoder import Encoder, build_encoder
from addnorm.model.quantize import CALIBRATION_FILE
from addnorm.model.text import EMBEDDING_FILE, EMBEDDING_GOLDEN_FILE, TOKENIZER_FILE

log = logging.getLogger("addnorm.export")


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    report: ParityReport
    graph: dict[str, int]


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("addnorm", "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def prepare_encoder(
    config: EncoderConfig,
    checkpoint: str | Path | None = None,
    seed: int = 0,
    from_bert: bool = False,
    state: dict | None = None,
    family: Family | None = None,
) -> Encoder:
    """The encoder to export: seeded default weights, or a checkpoint's (an encoder family's, export/families,
    with ``family``; ``from_bert``: BERT's); ``state``: the checkpoint already read (``weights.read_state_dict``)."""
    encoder = build_encoder(config, seed=seed)
    if checkpoint is None:
        return encoder
    state = read_state_dict(checkpoint) if state is None else state
    if family is None and from_bert:
        family = BERT
    if family is not None:
        state = family.block_state(state, config.num_layers, head=config.head)
    return load_state(encoder, state, checkpoint)


@traces.reusing()  # the gate's debug graph and the served graph: one trace (export/traces.py)
def export_artifact(
    encoder: Encoder,
    out_dir: str | Path,
    name: str = "encoder",
    opset: int = DEFAULT_OPSET,
    variant: str = "fp32",
    cases: list[Case] | None = None,
    attention: str = "auto",
    given: list[Case] | None = None,
    check: Callable[[Path], dict] | None = None,
    text: TextExport | None = None,
    labels: tuple[str, ...] = (),
    source: dict | None = None,
) -> ExportResult:
    """Export, check the graph, run the parity gate, then publish model, weights and manifest into ``out_dir``.

    ``cases``: the gate's synthetic inputs (export.cases.default_cases by default); ``given``: real inputs
    (``--calibration``), on which a lossy variant's quality is judged instead of on the synthetic ones. A few
    of them (or of the synthetic golden cases) are kept as the artifact's golden data. ``check``: one more check
    of the gated graph (its path -> figures kept in the manifest's parity as ``reference``; raises to refuse it),
    e.g. the comparison with transformers (export.cli); with ``text``, the embedding graph and tokenizer lie beside
    it when it runs. ``text``: the artifact takes token ids too (export/embedding.py: its own graph and gate).
    ``labels``: a classification head's label names by index (config.json's ``id2label``), kept in the manifest.

    Everything is written into a staging directory first; ``out_dir`` only changes when every gate passed, and then
    in one atomic swap (export/publish.py): whenever the export dies, ``out_dir`` holds the previous complete
    artifact or the new one. A write that fails (a full disk, a read-only directory) is an ``ExportError`` naming
    the file.
    """
    config = encoder.config
    try:
        form = resolve_attention(attention, opset)
    except AttentionError as exc:
        raise ExportError(str(exc)) from None
    out_dir = Path(out_dir)
    try:
        staging, beside = staging_for(out_dir)
    except OSError as exc:
        raise ExportError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
    try:
        log.info(
            "exporting %s as %s with %s attention (opset %d) to %s",
            _describe(config),
            variant,
            form,
            opset,
            out_dir,
        )
        given = list(given or [])
        synthetic_cases = cases if cases is not None else default_cases()
        plan = plan_for(encoder, variant, given or synthetic_cases)
        with _writing(out_dir, MODEL_FILE):
            model = build_graph(encoder, staging / MODEL_FILE, variant, opset, attention=form, plan=plan)
        graph = check_graph(model, config, variant, form)
        log.info(
            "graph checks passed: %d nodes, %d norm nodes, %d fused, %d attention",
            graph["nodes"],
            graph["norm_nodes"],
            graph["fused_nodes"],
            graph["attention_nodes"],
        )
        with _writing(out_dir, WEIGHTS_FILE):
            save_weights(encoder, staging / WEIGHTS_FILE)
        golden = golden_cases(given)
        all_cases = [*given, *(synthetic(synthetic_cases) if given else synthetic_cases)]
        all_cases += golden
        keep = frozenset(c.name for c in golden)
        report = gate(
            encoder, staging / MODEL_FILE, variant, opset, all_cases, attention=form, keep=keep, plan=plan
        )
        if not report.passed:
            raise ParityError(report)
        summary = report.summary()
        files = [MODEL_FILE, WEIGHTS_FILE, GOLDEN_FILE, MANIFEST_FILE]
        if text is not None:
            summary["embedding"] = _embedding(text, staging, out_dir, opset)
            files[-1:-1] = [EMBEDDING_FILE, TOKENIZER_FILE, EMBEDDING_GOLDEN_FILE]
        if check is not None:
            summary["reference"] = check(staging / MODEL_FILE)
        if text is not None and calibrated(config):
            with _writing(out_dir, CALIBRATION_FILE):
                count = write_calibration(staging, config, text.config, text.sentences)
            summary["calibration"] = {"sentences": count}
            files[-1:-1] = [CALIBRATION_FILE]
        with _writing(out_dir, GOLDEN_FILE):
            write_golden(
                report, staging / GOLDEN_FILE
            )  # checked again by every server that loads this artifact
        inputs, outputs = io_specs(config)
        manifest = Manifest(
            name=name,
            config=config,
            inputs=inputs,
            outputs=outputs,
            opset=opset,
            variant=variant,
            attention=form,
            model_sha256=sha256_file(staging / MODEL_FILE),
            versions=library_versions(),
            parity=summary,
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            golden_sha256=sha256_file(staging / GOLDEN_FILE),
            weights_sha256=sha256_file(staging / WEIGHTS_FILE),
            scheme=plan,
            text=None if text is None else text.config,
            labels=tuple(labels),
            source=dict(source or {}),
            embedding_sha256=sha256_file(staging / EMBEDDING_FILE) if text else "",
            tokenizer_sha256=sha256_file(staging / TOKENIZER_FILE) if text else "",
            embedding_golden_sha256=sha256_file(staging / EMBEDDING_GOLDEN_FILE) if text else "",
            calibration_sha256=(sha256_file(staging / CALIBRATION_FILE) if CALIBRATION_FILE in files else ""),
        )
        with _writing(out_dir, MANIFEST_FILE):
            manifest.save(staging)
            publish(staging, out_dir, tuple(files), beside)
        return ExportResult(out_dir, manifest, report, graph)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _embedding(text: TextExport, staging: Path, out_dir: Path, opset: int) -> dict:
    """The embedding layer's graph and the tokenizer into ``staging``, the graph gated (export/embedding.py)."""
    with _writing(out_dir, EMBEDDING_FILE):
        export_embedding(text.module, staging / EMBEDDING_FILE, opset)
    with _writing(out_dir, TOKENIZER_FILE):
        shutil.copyfile(text.tokenizer, staging / TOKENIZER_FILE)
    with _writing(out_dir, EMBEDDING_GOLDEN_FILE):
        write_embedding_golden(text.module, staging / EMBEDDING_GOLDEN_FILE)
    result = gate_embedding(text.module, staging / EMBEDDING_FILE)
    log.info(
        "embedding Add & Norm (%s, %d-token vocabulary): max abs err %.2e against float64 (bound %.2e) on %d tokens",
        text.config.family,
        text.config.vocab_size,
        result.max_abs,
        result.floor,
        result.tokens,
    )
    if not result.passed:
        raise ExportError(
            f"the embedding graph's max abs err {result.max_abs:.3e} against float64 is above its bound "
            f"{result.floor:.3e}: nothing was written"
        )
    return result.to_dict()


@contextlib.contextmanager
def _writing(out_dir: Path, name: str) -> Iterator[None]:
    """A failed write of ``name`` as one ExportError (safetensors raises its own error on a full disk)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ExportError(f"cannot write {name} for {out_dir}: {why}") from None


# The representative inputs a variant's plan is chosen on: enough tokens to see every channel's peaks, few enough
# for the float64 reference to take a second or two.
PLAN_TOKENS = 4096


def plan_for(encoder: Encoder, variant: str, cases: list[Case]) -> dict:
    """The variant's scheme parameters (``Variant.plan``), chosen on the representative ``cases`` (the given ones,
    else the synthetic ones), up to PLAN_TOKENS tokens; {} for a variant without any."""
    planner = get_variant(variant).plan
    if planner is None:
        return {}
    rng = np.random.default_rng([0, 3])
    inputs, tokens = [], 0
    for case in (c for c in cases if c.representative):
        x, mask = case.make(encoder.config.d_model, rng)
        if inputs and tokens + x.shape[0] * x.shape[1] > PLAN_TOKENS:
            break
        inputs.append((x, mask))
        tokens += x.shape[0] * x.shape[1]
    plan = planner(encoder, inputs)
    log.info("%s plan chosen on %d representative tokens", variant, tokens)
    return plan


def _describe(config: EncoderConfig) -> str:
    placement = "pre-norm" if config.norm_first else "post-norm"
    return (
        f"{config.num_layers}-layer {placement} encoder (d_model {config.d_model}, nhead {config.nhead}, "
        f"ff {config.dim_feedforward}{' gated' if config.feed_forward == 'gated' else ''}, {config.activation})"
        + (
            f" with {config.pooling} pooling{', L2-normalized' if config.normalize_pooled else ''}"
            if config.pooling != "none"
            else ""
        )
    )
