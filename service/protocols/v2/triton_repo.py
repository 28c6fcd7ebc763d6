"""addnorm-triton: write a Triton Inference Server model repository for an artifact.

    addnorm-triton --artifact artifacts/default --model-repository triton-repo [--max-batch-size 32] [--instances 1] [--kind cpu|gpu]

writes ``REPO/<name>/config.pbtxt`` (onnxruntime backend, the graph's inputs and outputs, dynamic batching, an
instance group), ``REPO/<name>/1/model.onnx`` and, beside it, the artifact's ``manifest.json`` for provenance.

Triton's dynamic batcher merges only requests whose shapes are equal, unless the graph takes its batch flattened:
a padded graph (``[batch, seq, d_model]`` with a padding mask) runs requests of different sequence lengths
separately, and clients that pad to a few bucket lengths, marking the padding in ``mask``, get batched together
and the same results on their real positions. A packed graph (``addnorm-export --packed``, model/packing.py) is
declared for Triton's ragged batching: ``embeddings`` and ``mask`` ragged (each request one sequence, ``[1, S,
d_model]`` and ``[1, S]``; the mask required, as Triton's onnxruntime backend wants of a ragged input), the
graph's ``offsets`` and ``longest`` computed by Triton (``batch_input``), and each request answered ``[1, S_max,
...]``: its own positions, then zeros up to the longest request it was batched with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from addnorm.commands import Parser, add_artifact
from addnorm.model.artifact import MANIFEST_FILE, ArtifactError, Manifest, load_verified
from addnorm.model.contract import EMBEDDINGS, MASK, api_specs
from addnorm.service.protocols.v2 import model_config
from addnorm.service.protocols.v2.grpc_codec import varint

KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
VERSION = "1"


def config_pbtxt(
    manifest: Manifest,
    max_batch_size: int = 32,
    instances: int = 1,
    kind: str = "cpu",
    mask_optional: bool = False,
) -> str:
    """The model's config.pbtxt, from the builder a running addnorm-serve answers ``/config`` with. Triton feeds
    the graph as it is: a seq-first graph (--no-batch-first) cannot be batched by Triton (its batch dim is not
    first), so max_batch_size is 0 and dims are written whole; ``mask`` is optional only when the repository's
    graph has a default for it (``with_mask_default``). A packed graph is declared for ragged batching, its inputs
    as clients send them (``api_specs``)."""
    packed = manifest.config.packed
    batched = manifest.config.batch_first and max_batch_size > 0
    inputs, outputs = api_specs(manifest.config) if packed else (manifest.inputs, manifest.outputs)
    config = model_config.build(
        manifest.name,
        inputs,
        outputs,
        max_batch_size=max_batch_size if batched else 0,
        instances=instances,
        kind=KINDS[kind],
        optional=(MASK,) if mask_optional else (),
        dynamic_batching={},  # merges requests of equal shape only, or of any length packed (the docstring)
        ragged=packed and batched,
    )
    head = (
        f"# addnorm-triton: {manifest.name} ({manifest.variant}, opset {manifest.opset}), "
        f"model sha256 {manifest.model_sha256}\n"
    )
    return head + model_config.as_pbtxt(config)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


# TensorProto {dims: 1, dims: 1, data_type: BOOL, name: "mask", raw_data: "\0"}: an all-false [1, 1] mask
_MASK_DEFAULT = b"\x08\x01\x08\x01\x10\x09\x42\x04mask\x4a\x01\x00"


def with_mask_default(graph: bytes) -> bytes:
    """The ONNX model with an initializer for its ``mask`` input: an input with an initializer is optional in
    ONNX (onnxruntime uses the initializer when the input is not fed), so Triton may leave the mask out. Written
    on the protobuf's wire format (ModelProto.graph is field 7, GraphProto.initializer field 5), as the serving
    install has no onnx package. Used only where ``_accepts_absent_mask`` shows the default gives the same
    answers as an all-false mask."""
    out, i = bytearray(), 0
    while i < len(graph):
        key, j = _read_varint(graph, i)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, j = _read_varint(graph, j)
            body = graph[j : j + length]
            if field == 7:
                body += b"\x2a" + varint(len(_MASK_DEFAULT)) + _MASK_DEFAULT
            out += varint(key) + varint(len(body)) + body
            i = j + length
        else:  # a varint, 64-bit or 32-bit field, copied as it is
            end = _read_varint(graph, j)[1] if wire == 0 else j + (8 if wire == 1 else 4)
            out += graph[i:end]
            i = end
    return bytes(out)


def _accepts_absent_mask(graph: bytes, manifest: Manifest) -> bool:
    """Whether the graph with its mask default answers a request without a mask exactly as with an all-false one
    (the mha form: the mask only picks the padded branch; the other forms reshape the mask by the batch and
    fail). A mask that is sent overrides the default, so padded requests are answered as by the export's graph."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # a refusal below is an answer, not an error to print
    try:
        sess = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((2, 5, manifest.config.d_model))
        x = x.astype(manifest.input(EMBEDDINGS).dtype)
        if not manifest.config.batch_first:
            x = x.transpose(1, 0, 2).copy()  # the graph takes (seq, batch, d_model); the mask is (batch, seq)
        absent = sess.run(None, {EMBEDDINGS: x})[0]
        given = sess.run(None, {EMBEDDINGS: x, MASK: np.zeros((2, 5), bool)})[0]
        return bool(np.array_equal(absent, given))
    except Exception:  # onnxruntime refused it: the mask stays required
        return False


def write_repository(
    artifact: str | Path, repo: str | Path, max_batch_size: int = 32, instances: int = 1, kind: str = "cpu"
) -> Path:
    """Write (or replace) this artifact's model in the repository; returns the model's folder. Where the graph
    takes a default for its mask (``with_mask_default``), the repository's graph has one and declares the mask
    optional, and the manifest beside it records the new graph's sha256 (the export's in exported_model_sha256)."""
    manifest, model_path = load_verified(artifact)
    model_dir = Path(repo) / manifest.name
    version = model_dir / VERSION
    version.mkdir(parents=True, exist_ok=True)
    original = model_path.read_bytes()
    graph = with_mask_default(original)
    optional = _accepts_absent_mask(graph, manifest)
    (version / "model.onnx").write_bytes(graph if optional else original)
    doc = json.loads((Path(artifact) / MANIFEST_FILE).read_text())
    if optional:
        doc["exported_model_sha256"] = doc["model_sha256"]
        doc["model_sha256"] = hashlib.sha256(graph).hexdigest()
    (version / MANIFEST_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    config = config_pbtxt(manifest, max_batch_size, instances, kind, mask_optional=optional)
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="addnorm-triton",
        description="Write a Triton Inference Server model repository (onnxruntime backend) for an addnorm "
        "artifact: REPO/<name>/config.pbtxt and REPO/<name>/1/model.onnx with the manifest beside it. "
        "Triton batches only requests of equal shape: pad to a few sequence lengths (docs/deployment.md, 'Scaling out'), or "
        "export with --packed, which this declares for Triton's ragged batching (one sequence per request).",
    )
    add_artifact(p, "artifact directory from addnorm-export")
    p.add_argument(
        "--model-repository",
        type=Path,
        required=True,
        metavar="REPO",
        help="Triton model repository to write into (created if missing; addnorm-serve and tritonserver read it "
        "with --model-repository)",
    )
    p.add_argument("--max-batch-size", type=int, default=32, help="largest batch Triton forms")
    p.add_argument("--instances", type=int, default=1, help="model instances (sessions)")
    p.add_argument("--kind", choices=sorted(KINDS), default="cpu", help="instance kind")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_batch_size < 0 or args.instances < 1:
        print("error: --max-batch-size must be >= 0 and --instances >= 1", file=sys.stderr)
        return 2
    try:
        model_dir = write_repository(
            args.artifact, args.model_repository, args.max_batch_size, args.instances, args.kind
        )
    except (ArtifactError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/{VERSION}/model.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
