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

from addnorm.model.artifact import Manifest, sha256_file
from addnorm.service.protocols.v2.triton_repo import main
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
    assert (
        main(
            [
                "--artifact",
                str(tiny_artifact),
                "--model-repository",
                str(repo),
                "--max-batch-size",
                "16",
                "--instances",
                "2",
            ]
        )
        == 0
    )
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
    assert (
        main(
            [
                "--artifact",
                str(tiny_artifact),
                "--model-repository",
                str(tmp_path),
                "--kind",
                "gpu",
                "--max-batch-size",
                "0",
            ]
        )
        == 0
    )
    config = parse(tmp_path / "encoder" / "config.pbtxt")
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    check_against_graph(config, tmp_path / "encoder" / "1" / "model.onnx", batched=False)


def test_a_seq_first_graph_is_written_unbatched(tmp_path):
    """(seq, batch, d_model) graphs: Triton batches along the first dim, so it must not batch these."""
    art = export_to(tmp_path / "seq_first", TINY.__class__(**{**TINY.to_dict(), "batch_first": False}))
    assert main(["--artifact", str(art), "--model-repository", str(tmp_path / "repo")]) == 0
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
    assert main(["--artifact", str(src), "--model-repository", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err  # each case its own cause, not the other's
    assert not (tmp_path / "repo").exists()


def test_a_graph_that_needs_its_mask_keeps_it_required(tmp_path):
    """The decomposed form reshapes the mask by the batch: a default would fail, so none is written and the mask
    stays required; the graph is the export's, byte for byte."""
    art = export_to(tmp_path / "decomposed", TINY, attention="decomposed")
    assert main(["--artifact", str(art), "--model-repository", str(tmp_path / "repo")]) == 0
    config = parse(tmp_path / "repo" / "encoder" / "config.pbtxt")
    assert [i.optional for i in config.input] == [False, False]
    written = tmp_path / "repo" / "encoder" / "1" / "model.onnx"
    assert sha256_file(written) == Manifest.load(art).model_sha256
    check_against_graph(config, written, batched=True)


def triton_ragged_feed(requests: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """What Triton's onnxruntime backend feeds a model configured for ragged batching: each ragged input's
    requests concatenated flat, BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO of embeddings as int32, and
    BATCH_MAX_ELEMENT_COUNT_AS_SHAPE as a tensor of that shape (its values never written)."""
    counts = [x.size for x, _ in requests]
    return {
        "embeddings": np.concatenate([x.ravel() for x, _ in requests]),
        "mask": np.concatenate([m.ravel() for _, m in requests]),
        "offsets": np.array([0, *np.cumsum(counts)], np.int32),
        "longest": np.empty(max(counts), np.int32),
    }


def test_a_packed_graph_is_declared_for_triton_ragged_batching_and_answers_each_request_as_alone(tmp_path):
    """Ragged embeddings and mask (the mask required: Triton refuses an optional ragged input), offsets and longest
    as batch inputs of embeddings; fed as Triton's backend feeds it, each request's rows of the batched answer are
    its answer alone, zeros beyond its length."""
    import dataclasses

    artifact = export_to(tmp_path / "a", dataclasses.replace(TINY, packed=True, pooling="mean"))
    assert main(["--artifact", str(artifact), "--model-repository", str(tmp_path / "repo")]) == 0
    config = parse(tmp_path / "repo" / "encoder" / "config.pbtxt")
    assert config.max_batch_size == 32
    assert [(i.name, i.allow_ragged_batch, i.optional, list(i.dims)) for i in config.input] == [
        ("embeddings", True, False, [-1, TINY.d_model]),
        ("mask", True, False, [-1]),
    ]
    assert [
        (mc.BatchInput.Kind.Name(b.kind), list(b.target_name), b.data_type, list(b.source_input))
        for b in config.batch_input
    ] == [
        ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", ["offsets"], mc.TYPE_INT32, ["embeddings"]),
        ("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", ["longest"], mc.TYPE_INT32, ["embeddings"]),
    ]
    assert [(o.name, list(o.dims)) for o in config.output] == [
        ("encoded", [-1, TINY.d_model]),
        ("pooled", [TINY.d_model]),
    ]
    sess = ort.InferenceSession(
        str(tmp_path / "repo" / "encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    # the backend checks a ragged input is [-1] in the graph
    assert {i.name: i.shape for i in sess.get_inputs()}["embeddings"] == ["elements"]
    rng = np.random.default_rng(0)
    requests = []
    for n in (4, 11, 1, 7):
        mask = np.zeros((1, n), bool)
        mask[0, n - 1 :] = n > 2  # a client's own padding in some
        requests.append((rng.standard_normal((1, n, TINY.d_model)).astype(np.float32), mask))
    encoded, pooled = sess.run(None, triton_ragged_feed(requests))
    assert encoded.shape == (4, 11, TINY.d_model) and pooled.shape == (4, TINY.d_model)
    for i, request in enumerate(requests):
        alone_encoded, alone_pooled = sess.run(None, triton_ragged_feed([request]))
        n = request[0].shape[1]
        np.testing.assert_allclose(encoded[i, :n], alone_encoded[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(pooled[i], alone_pooled[0], rtol=0, atol=1e-5)
        assert not encoded[i, n:].any()
