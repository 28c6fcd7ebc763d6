"""Export an encoder into an artifact directory, gated by graph checks and parity."""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from export.checks import check_graph
from export.onnx_export import DEFAULT_OPSET, INPUT_NAMES, OUTPUT_NAME
from export.parity import Case, ParityReport, make_session, run_parity
from export.variants import build_graph
from export.weights import load_weights, save_weights
from model.artifact import MANIFEST_FILE, MODEL_FILE, WEIGHTS_FILE, Manifest, TensorSpec, sha256_file
from model.config import EncoderConfig
from model.encoder import Encoder, build_encoder

log = logging.getLogger("addnorm.export")


class ParityError(RuntimeError):
    """The exported graph does not match torch within tolerance; no manifest was written."""

    def __init__(self, report: ParityReport) -> None:
        s = report.summary()
        w = s["worst"]
        super().__init__(
            f"parity failed: max abs err {s['max_abs_err']:.3e} (atol {report.tolerance.atol:g}, "
            f"rtol {report.tolerance.rtol:g}); worst element: case '{w['case']}', output {w['output']}, "
            f"index {w['index']}, onnx {w['onnx']!r} vs torch {w['torch']!r}"
        )
        self.report = report


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    report: ParityReport
    graph: dict[str, int]


def io_specs(config: EncoderConfig) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    emb_shape = ("batch", "seq", config.d_model) if config.batch_first else ("seq", "batch", config.d_model)
    inputs = (
        TensorSpec(INPUT_NAMES[0], "float32", emb_shape),
        TensorSpec(INPUT_NAMES[1], "bool", ("batch", "seq")),
    )
    return inputs, (TensorSpec(OUTPUT_NAME, "float32", emb_shape),)


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("addnorm", "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def prepare_encoder(
    config: EncoderConfig, checkpoint: str | Path | None = None, seed: int = 0, from_bert: bool = False
) -> Encoder:
    encoder = build_encoder(config, seed=seed)
    if checkpoint is not None:
        load_weights(encoder, checkpoint, from_bert=from_bert)
    return encoder


def export_artifact(
    encoder: Encoder,
    out_dir: str | Path,
    name: str = "encoder",
    opset: int = DEFAULT_OPSET,
    variant: str = "fp32",
    cases: list[Case] | None = None,
) -> ExportResult:
    """Export, check the graph, run the parity gate, then publish model, weights and manifest into ``out_dir``.

    Everything is written into a staging directory first; ``out_dir`` only changes when every gate passed, and
    the manifest is moved in last, so a reader never sees a manifest that describes a different graph.
    """
    config = encoder.config
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        log.info("exporting %s as %s (opset %d) to %s", _describe(config), variant, opset, out_dir)
        model = build_graph(encoder, staging / MODEL_FILE, variant, opset)
        graph = check_graph(model, config, fused=variant == "fused")
        log.info("graph checks passed: %d nodes, %d norm nodes, %d fused", graph["nodes"], graph["norm_nodes"],
                 graph["fused_nodes"])  # fmt: skip
        save_weights(encoder, staging / WEIGHTS_FILE)
        # A debug graph of the same variant also outputs every Add & Norm result, for per-sublayer parity.
        build_graph(encoder, staging / "debug.onnx", variant, opset, with_steps=True)
        report = run_parity(encoder, make_session(staging / MODEL_FILE), cases,
                            debug_session=make_session(staging / "debug.onnx"), variant=variant)  # fmt: skip
        if not report.passed:
            raise ParityError(report)
        inputs, outputs = io_specs(config)
        manifest = Manifest(
            name=name,
            config=config,
            inputs=inputs,
            outputs=outputs,
            opset=opset,
            variant=variant,
            model_sha256=sha256_file(staging / MODEL_FILE),
            versions=library_versions(),
            parity=report.summary(),
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.save(staging)
        (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # never leave an old manifest beside a new graph
        for fname in (MODEL_FILE, WEIGHTS_FILE, MANIFEST_FILE):
            os.replace(staging / fname, out_dir / fname)
        return ExportResult(out_dir, manifest, report, graph)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _describe(config: EncoderConfig) -> str:
    placement = "pre-norm" if config.norm_first else "post-norm"
    return (
        f"{config.num_layers}-layer {placement} encoder (d_model {config.d_model}, nhead {config.nhead}, "
        f"ff {config.dim_feedforward}, {config.activation})"
    )
