"""An ids artifact as one graph under transformers' names, for the tools that load Hugging Face ONNX exports
(sentence-transformers' ``backend="onnx"``, TEI's onnxruntime backend, optimum): ``input_ids``,
``attention_mask`` (int64, 1 = a real token) [, ``token_type_ids``] -> ``last_hidden_state`` [, ``pooled``]
[, ``logits``: a classification head's scores, as transformers' ``*ForSequenceClassification`` names them].

The embedding graph and the block are joined as they are (the same nodes and weights the server runs), with one
adapter between them: the block's mask (bool, true = padding) is ``attention_mask == 0``.

    python -m addnorm.export.interop ARTIFACT MODEL_DIR OUT   # OUT: a copy of MODEL_DIR with onnx/model.onnx
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, compose, helper

from addnorm.commands import Parser
from addnorm.model.artifact import MODEL_FILE, Manifest
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, SCORES
from addnorm.model.text import ATTENTION_MASK, EMBEDDING_FILE

LAST_HIDDEN_STATE = "last_hidden_state"


def joined(artifact: Path) -> onnx.ModelProto:
    """The artifact's embedding graph and block as one graph with transformers' input and output names."""
    manifest = Manifest.load(artifact)
    if manifest.text is None:
        raise ValueError(
            f"{artifact} takes embeddings only: export it from a model directory with --inputs ids"
        )
    if not manifest.config.batch_first or manifest.config.packed:
        raise ValueError("only a padded, batch-first block joins transformers' layout")
    emb = compose.add_prefix(onnx.load(str(artifact / EMBEDDING_FILE)), "embedding/")
    block = compose.add_prefix(onnx.load(str(artifact / MODEL_FILE)), "block/")
    ids = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
        for n in manifest.text.input_names
    ]
    attention = helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch", "seq"])
    names = {ENCODED: LAST_HIDDEN_STATE, SCORES: "logits"}
    outputs = [
        helper.make_tensor_value_info(
            names.get(o.name[len("block/") :], o.name[len("block/") :]), TensorProto.FLOAT, None
        )
        for o in block.graph.output
    ]
    nodes = [helper.make_node("Identity", [i.name], [f"embedding/{i.name}"]) for i in ids]
    nodes += list(emb.graph.node)
    nodes.append(helper.make_node("Identity", [f"embedding/{EMBEDDINGS}"], [f"block/{EMBEDDINGS}"]))
    zero = helper.make_tensor("adapter/zero", TensorProto.INT64, [], [0])
    nodes.append(
        helper.make_node("Equal", [ATTENTION_MASK, "adapter/zero"], [f"block/{MASK}"])
    )  # true = padding
    nodes += list(block.graph.node)
    nodes += [
        helper.make_node("Identity", [o.name], [out.name])
        for o, out in zip(block.graph.output, outputs, strict=True)
    ]
    graph = helper.make_graph(
        nodes,
        f"{manifest.name} (addnorm, transformers' names)",
        [*ids, attention],
        outputs,
        initializer=[*emb.graph.initializer, zero, *block.graph.initializer],
    )
    opsets: dict[str, int] = {}
    for model in (emb, block):
        for o in model.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = max(emb.ir_version, block.ir_version)
    model.functions.extend([*emb.functions, *block.functions])
    return model


def write(artifact: Path, model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` with the joined graph as ``onnx/model.onnx`` (where sentence-transformers and
    optimum look for it)."""
    if out.exists():
        raise FileExistsError(f"{out} exists")
    shutil.copytree(
        model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino")
    )
    (out / "onnx").mkdir()
    onnx.save(joined(artifact), str(out / "onnx" / "model.onnx"))
    return out / "onnx" / "model.onnx"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m addnorm.export.interop", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument(
        "model_dir", type=Path, help="the model directory it was exported from (config, tokenizer)"
    )
    p.add_argument("out", type=Path, help="a new directory: the model directory's files and onnx/model.onnx")
    args = p.parse_args(argv)
    try:
        print(f"wrote {write(args.artifact, args.model_dir, args.out)}")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
