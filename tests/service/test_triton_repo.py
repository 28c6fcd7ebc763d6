"""addnorm-triton: the model repository it writes, parsed strictly with the protobuf schema tritonclient ships.

No Triton server runs here: the config is checked against Triton's own ModelConfig schema and the ONNX graph.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from model.artifact import Manifest, sha256_file
from service.protocols.v2.triton_repo import main
from tests.conftest import TINY, export_to

ORT_TO_TRITON = {"tensor(float)": mc.TYPE_FP32, "tensor(bool)": mc.TYPE_BOOL, "tensor(float16)": mc.TYPE_FP16}


def parse(path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())  # unknown fields or bad enums raise


def check_against_graph(config: mc.ModelConfig, model_path, batched: bool) -> None:
    """Every declared tensor is the graph's (an input with a default is one of onnxruntime's overridable
    initializers: optional in the config, and only then)."""
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    defaults = {i.name for i in sess.get_overridable_initializers()}
    inputs = sorted([*sess.get_inputs(), *sess.get_overridable_initializers()], key=lambda a: a.name)
    assert {i.name for i in config.input if i.optional} == defaults
    for declared, actual in ((config.input, inputs), (config.output, sess.get_outputs())):
        assert [t.name for t in declared] == [a.name for a in actual]
        for t, a in zip(declared, actual, strict=True):
            assert t.data_type == ORT_TO_TRITON[a.type]
            shape = a.shape[1:] if batched else a.shape
            assert list(t.dims) == [d if isinstance(d, int) else -1 for d in shape]


def test_repository_matches_the_graph_and_triton_schema(tiny_artifact, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main([str(tiny_artifact), str(repo), "--max-batch-size", "16", "--instances", "2"]) == 0
    assert "config.pbtxt" in capsys.readouterr().out
    manifest = Manifest.load(tiny_artifact)
    model = repo / manifest.name
    config = parse(model / "config.pbtxt")
    assert config.name == manifest.name and config.backend == "onnxruntime"
    assert config.max_batch_size == 16 and config.HasField("dynamic_batching")
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
    assert list(config.version_policy.specific.versions) == [1]
    check_against_graph(config, model / "1" / "model.onnx", batched=True)
    # the mha form takes a default for its mask: the repository's graph has one (a new sha256, recorded beside
    # it with the export's), and the mask is optional, as Triton's core needs for the README's request
    assert [i.optional for i in config.input] == [False, True]
    beside = json.loads((model / "1" / "manifest.json").read_text())
    assert beside["model_sha256"] == sha256_file(model / "1" / "model.onnx") != manifest.model_sha256
    assert beside["exported_model_sha256"] == manifest.model_sha256
    # what Triton would run gives the artifact's own results: padded, not, and with no mask at all
    x = np.random.default_rng(0).standard_normal((2, 3, TINY.d_model)).astype(np.float32)
    ours = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    theirs = ort.InferenceSession(str(model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    padded = np.zeros((2, 3), bool)
    padded[1, 2] = True
    for mask in (np.zeros((2, 3), bool), padded):
        run = {"embeddings": x, "mask": mask}
        np.testing.assert_array_equal(ours.run(None, run)[0], theirs.run(None, run)[0])
    unmasked = {"embeddings": x, "mask": np.zeros((2, 3), bool)}
    np.testing.assert_array_equal(ours.run(None, unmasked)[0], theirs.run(None, {"embeddings": x})[0])


def test_gpu_kind_and_no_batching(tiny_artifact, tmp_path):
    assert main([str(tiny_artifact), str(tmp_path), "--kind", "gpu", "--max-batch-size", "0"]) == 0
    config = parse(tmp_path / "encoder" / "config.pbtxt")
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    check_against_graph(config, tmp_path / "encoder" / "1" / "model.onnx", batched=False)


def test_a_seq_first_graph_is_written_unbatched(tmp_path):
    """(seq, batch, d_model) graphs: Triton batches along the first dim, so it must not batch these."""
    art = export_to(tmp_path / "seq_first", TINY.__class__(**{**TINY.to_dict(), "batch_first": False}))
    assert main([str(art), str(tmp_path / "repo")]) == 0
    config = parse(tmp_path / "repo" / "encoder" / "config.pbtxt")
    assert config.max_batch_size == 0
    check_against_graph(config, tmp_path / "repo" / "encoder" / "1" / "model.onnx", batched=False)


@pytest.mark.parametrize(("bad", "named"), [("missing", "does not exist"), ("tampered", "sha256")])
def test_a_bad_artifact_exits_1_naming_it(tiny_artifact, tmp_path, capsys, bad, named):
    if bad == "missing":
        src = tmp_path / "nothing"
    else:
        src = tmp_path / "copy"
        src.mkdir()
        for f in tiny_artifact.iterdir():
            if f.is_file():
                (src / f.name).write_bytes(f.read_bytes())
        (src / "model.onnx").write_bytes((src / "model.onnx").read_bytes() + b"\0")
    assert main([str(src), str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err  # each case its own cause, not the other's
    assert not (tmp_path / "repo").exists()


def test_a_graph_that_needs_its_mask_keeps_it_required(tmp_path):
    """The decomposed form reshapes the mask by the batch: a default would fail, so none is written and the mask
    stays required; the graph is the export's, byte for byte."""
    art = export_to(tmp_path / "decomposed", TINY, attention="decomposed")
    assert main([str(art), str(tmp_path / "repo")]) == 0
    config = parse(tmp_path / "repo" / "encoder" / "config.pbtxt")
    assert [i.optional for i in config.input] == [False, False]
    written = tmp_path / "repo" / "encoder" / "1" / "model.onnx"
    assert sha256_file(written) == Manifest.load(art).model_sha256
    check_against_graph(config, written, batched=True)
