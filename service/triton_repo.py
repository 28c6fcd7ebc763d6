"""addnorm-triton: write a Triton Inference Server model repository for an artifact.

    addnorm-triton artifacts/default triton-repo [--max-batch-size 32] [--instances 1] [--kind cpu|gpu]

writes ``REPO/<name>/config.pbtxt`` (onnxruntime backend, the graph's inputs and outputs, dynamic batching, an
instance group), ``REPO/<name>/1/model.onnx`` and, beside it, the artifact's ``manifest.json`` for provenance.

Triton's dynamic batcher merges only requests whose shapes are equal (ragged batching needs a graph that takes
its batch flattened, which this one does not: it takes padded ``[batch, seq, d_model]`` with a padding mask). So
requests of different sequence lengths run separately; clients that pad to a few bucket lengths, marking the
padding in ``mask``, get batched together and the same results on their real positions.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from model.artifact import MANIFEST_FILE, ArtifactError, Manifest, load_verified
from service.protocols.v2 import model_config

KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
VERSION = "1"


def config_pbtxt(manifest: Manifest, max_batch_size: int = 32, instances: int = 1, kind: str = "cpu") -> str:
    """The model's config.pbtxt, from the builder a running addnorm-serve answers ``/config`` with. Triton feeds
    the graph as it is: a seq-first graph (--no-batch-first) cannot be batched by Triton (its batch dim is not
    first), so max_batch_size is 0 and dims are written whole; and ``mask`` stays required, as the graph needs
    it (addnorm-serve fills it in when a request leaves it out)."""
    batched = manifest.config.batch_first and max_batch_size > 0
    config = model_config.build(
        manifest.name,
        manifest.inputs,
        manifest.outputs,
        max_batch_size=max_batch_size if batched else 0,
        instances=instances,
        kind=KINDS[kind],
        dynamic_batching={},  # merges requests of equal shape only (see the module docstring)
    )
    head = (
        f"# addnorm-triton: {manifest.name} ({manifest.variant}, opset {manifest.opset}), "
        f"model sha256 {manifest.model_sha256}\n"
    )
    return head + model_config.as_pbtxt(config)


def write_repository(
    artifact: str | Path, repo: str | Path, max_batch_size: int = 32, instances: int = 1, kind: str = "cpu"
) -> Path:
    """Write (or replace) this artifact's model in the repository; returns the model's folder."""
    manifest, model_path = load_verified(artifact)
    model_dir = Path(repo) / manifest.name
    version = model_dir / VERSION
    version.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_path, version / "model.onnx")
    shutil.copyfile(Path(artifact) / MANIFEST_FILE, version / MANIFEST_FILE)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(manifest, max_batch_size, instances, kind))
    return model_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="addnorm-triton",
        description="Write a Triton Inference Server model repository (onnxruntime backend) for an addnorm "
        "artifact: REPO_DIR/<name>/config.pbtxt and REPO_DIR/<name>/1/model.onnx with the manifest beside it. "
        "Triton batches only requests of equal shape: pad to a few sequence lengths (README 'Scaling out').",
    )
    p.add_argument("artifact_dir", type=Path, help="artifact directory from addnorm-export")
    p.add_argument("repo_dir", type=Path, help="model repository to write into (created if missing)")
    p.add_argument("--max-batch-size", type=int, default=32, help="largest batch Triton forms (default 32)")
    p.add_argument("--instances", type=int, default=1, help="model instances (sessions) (default 1)")
    p.add_argument("--kind", choices=sorted(KINDS), default="cpu", help="instance kind (default cpu)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_batch_size < 0 or args.instances < 1:
        print("error: --max-batch-size must be >= 0 and --instances >= 1", file=sys.stderr)
        return 2
    try:
        model_dir = write_repository(
            args.artifact_dir, args.repo_dir, args.max_batch_size, args.instances, args.kind
        )
    except (ArtifactError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/{VERSION}/model.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
