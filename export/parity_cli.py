"""addnorm-parity: re-check an existing artifact against torch (from its weights.safetensors)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnxruntime as ort

from addnorm.commands import Parser, add_artifact, add_output, add_providers
from addnorm.export.cases import Given, adversarial_cases, default_cases, synthetic
from addnorm.export.gate import gate
from addnorm.export.onnx_export import ExportError
from addnorm.export.parity import GRAPH_OPT_LEVELS, SEED, ParityReport
from addnorm.export.report import format_table, write_report
from addnorm.export.weights import CheckpointError, load_weights
from addnorm.model.artifact import GOLDEN_FILE, WEIGHTS_FILE, ArtifactError, load_verified
from addnorm.model.contract import EMBEDDINGS, MASK
from addnorm.model.encoder import Encoder
from addnorm.model.golden import load_golden, representative
from addnorm.model.runtime import ProviderError, resolve_providers


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="addnorm-parity",
        description="Re-run the parity gate on an artifact: onnxruntime vs torch fp32 (and a float64 oracle) on "
        "random inputs of many sizes, with and without masks. Exits 1 when a case is beyond tolerance.",
    )
    add_artifact(p, "artifact directory to check (manifest.json, model.onnx, weights.safetensors)")
    add_output(p)
    p.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write parity.json, parity.md and PNG plots (errors per Add & Norm step, error vs input "
        "conditioning) into DIR",
    )
    p.add_argument("--adversarial", action="store_true", help="add the adversarial input suite")
    p.add_argument(
        "--graph-optimization",
        choices=list(GRAPH_OPT_LEVELS),
        default="all",
        help="onnxruntime graph optimization level",
    )
    p.add_argument("--seed", type=int, default=SEED, help="seed of the gate's random inputs")
    add_providers(p)
    p.add_argument(
        "--no-steps",
        action="store_true",
        help="skip the per-Add & Norm comparison (saves re-exporting the debug graph)",
    )
    return p


def check_artifact(
    directory: Path,
    adversarial: bool = False,
    graph_optimization: str = "all",
    seed: int = SEED,
    steps: bool = True,
    providers: str = "auto",
) -> ParityReport:
    """Re-run the gate on an artifact from its saved weights; with ``steps``, every Add & Norm step too. An artifact
    exported with real inputs (``--calibration``) is judged as its export was: its golden cases (those inputs) are
    the representative ones, the synthetic cases test the graph."""
    manifest, model_path = load_verified(directory)
    encoder = load_weights(Encoder(manifest.config), directory / WEIGHTS_FILE)
    cases = default_cases() + (adversarial_cases() if adversarial else [])
    if manifest.parity.get("inputs") == "given" and manifest.golden_sha256:
        cases = _golden_given(directory / GOLDEN_FILE) + synthetic(cases)
    return gate(
        encoder,
        model_path,
        manifest.variant,
        manifest.opset,
        cases,
        steps=steps,
        graph_optimization=graph_optimization,
        seed=seed,
        attention=manifest.attention,
        providers=resolve_providers(providers, ort.get_available_providers()),
        plan=manifest.scheme,
    )


def _golden_given(path: Path) -> list[Given]:
    """The artifact's golden cases that hold real inputs, as gate cases (stored batch-first, as the service speaks)."""
    cases = []
    for name, arrays in load_golden(path).items():
        if not representative(arrays):
            continue
        x, mask = arrays[EMBEDDINGS], arrays[MASK]
        cases.append(Given(name, x.shape[0], x.shape[1], embeddings=x, mask=mask))
    return cases


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = check_artifact(
            args.artifact,
            args.adversarial,
            args.graph_optimization,
            args.seed,
            not args.no_steps,
            args.providers,
        )
    except (ArtifactError, CheckpointError, ExportError, ProviderError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not args.quiet or not report.passed:
        print(format_table(report, verbose=args.verbose))
    if args.report:
        for path in write_report(report, args.report):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
