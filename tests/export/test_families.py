"""Every encoder family (export/families), exported from a tiny random model directory built with transformers'
own classes, with the embedding layer (--inputs ids): text tokenized as the server tokenizes it, through the
embedding graph and the block, equals transformers' AutoModel on the same ids (and sentence-transformers' pooling
of it) at the float32 floor for fp32 graphs, and within each lossy variant's own tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from addnorm.export import cli, hf, model_dir
from addnorm.model.artifact import Manifest
from addnorm.model.contract import ENCODED
from addnorm.model.text import TOKENIZER_FILE
from addnorm.model.tokenize import TextTokenizer
from addnorm.model.verdict import float32_floor
from tests.conftest import ROOT
from tests.text_models import TEXTS, assert_like_transformers, make_model_dir, transformers_vectors

pytestmark = [pytest.mark.export, pytest.mark.usefixtures("one_trace_per_model")]
FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra")
# (variant, attention): each family in fp32 with the default attention; the lossy and fused variants and the other
# attention forms on MPNet, whose relative position bias enters the block's attention. A variant changes the block
# only (the embedding graph, where the families' position schemes live, is float32 in every variant), and BERT's
# block in every variant and attention form is tested on real all-MiniLM-L6-v2 weights against transformers
# (tests/test_real_model.py), so BERT and RoBERTa repeat nothing here in them (10 exports, ~100 s of the suite's CPU).
FORMS = [(f, "fp32", "auto") for f in FAMILIES] + [
    ("mpnet", v, a)
    for v, a in (
        ("fused", "auto"),
        ("fp16", "auto"),
        ("int8", "auto"),
        ("fp32", "decomposed"),
        ("fp32", "onnx"),
    )
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_model_dir(f, root / f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.mark.parametrize("family, variant, attention", FORMS)
def test_text_through_the_exported_graphs_equals_transformers(
    model_dirs, tmp_path, family, variant, attention, capsys
):
    directory = model_dirs[family]
    out = tmp_path / "artifact"
    args = ["--from", str(directory), "--artifact", str(out), "--variant", variant, "--attention", attention]
    if attention == "onnx":
        args += ["--opset", "23"]
    assert cli.main(args) == 0, capsys.readouterr().err
    manifest = Manifest.load(out)
    assert manifest.text is not None and manifest.text.family == family
    assert (
        manifest.parity["embedding"]["passed"] and manifest.parity["reference"]["ids"]["graph"]["tokens"] > 0
    )
    tokenizer = TextTokenizer((out / TOKENIZER_FILE).read_bytes(), manifest.text)
    batch = tokenizer.encode(TEXTS)
    assert max(batch.lengths) > 16  # the tokenizer.json's own truncation (16) is not the server's
    assert_like_transformers(out, manifest.config, batch, directory, variant)


def _copy_with(source: Path, directory: Path, **config) -> Path:
    """A copy of the model directory ``source`` whose config.json has ``config``'s fields changed."""
    directory.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (directory / f.name).write_bytes(f.read_bytes())
    fields = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**fields, **config}))
    return directory


def test_an_unknown_model_type_names_the_supported_ones(model_dirs, tmp_path, capsys):
    directory = _copy_with(model_dirs["bert"], tmp_path / "gpt", model_type="gpt2")
    assert cli.main(["--from", str(directory), "--artifact", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type 'gpt2'" in err
    assert "bert, distilbert, electra, modernbert, mpnet, roberta, xlm-roberta" in err


def test_an_electra_whose_embeddings_are_narrower_than_its_layers_is_refused_saying_why(
    model_dirs, tmp_path, capsys
):
    """ELECTRA-small's embeddings_project (embedding_size 128, hidden_size 256) is not computed: refused by name."""
    directory = _copy_with(model_dirs["electra"], tmp_path / "small", embedding_size=16)
    assert cli.main(["--from", str(directory), "--artifact", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "embedding_size 16 and hidden_size 32" in err and "embeddings_project" in err
    )
    assert not (tmp_path / "out").exists()


def test_inputs_embeddings_keeps_the_block_alone_and_ids_needs_a_tokenizer(model_dirs, tmp_path, capsys):
    out = tmp_path / "block"
    assert (
        cli.main(["--from", str(model_dirs["bert"]), "--artifact", str(out), "--inputs", "embeddings", "-q"])
        == 0
    )
    manifest = Manifest.load(out)
    assert manifest.text is None and not (out / "embedding.onnx").exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model_dirs["bert"] / name).read_bytes())
    assert cli.main(["--from", str(bare), "--artifact", str(tmp_path / "x"), "--inputs", "ids"]) == 2
    assert "needs --from DIR, a model directory with a tokenizer.json" in capsys.readouterr().err
    # --from-bert is the same flag
    assert (
        cli.main(["--from-bert", str(model_dirs["bert"]), "--artifact", str(tmp_path / "alias"), "-q"]) == 0
    )
    assert Manifest.load(tmp_path / "alias").text is not None


@pytest.mark.parametrize("family", ["bert", "distilbert", "mpnet"])
def test_the_joined_graph_speaks_transformers_names(model_dirs, tmp_path, family):
    """export/interop.py: the artifact as one graph with transformers' inputs and outputs (what sentence-transformers'
    ONNX backend and optimum load from onnx/model.onnx), answering as transformers' AutoModel on the same ids.
    sentence-transformers' backend="onnx" itself needs optimum-onnx, which pins transformers < 4.58 (the dev extra has
    5.x): it loaded the joined all-MiniLM-L6-v2 graph in a separate environment (issue 65's note)."""
    import onnxruntime as ort

    from addnorm.export import interop

    artifact = tmp_path / "artifact"
    assert cli.main(["--from", str(model_dirs[family]), "--artifact", str(artifact), "-q"]) == 0
    path = interop.write(artifact, model_dirs[family], tmp_path / "st")
    assert (tmp_path / "st" / "tokenizer.json").is_file() and not (
        tmp_path / "st" / "model.safetensors"
    ).exists()
    session = ort.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    assert names == (
        ["input_ids", "attention_mask"]
        if family in ("distilbert", "mpnet")
        else ["input_ids", "token_type_ids", "attention_mask"]
    )
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state", "pooled"]
    manifest = Manifest.load(artifact)
    batch = TextTokenizer((artifact / TOKENIZER_FILE).read_bytes(), manifest.text).encode(TEXTS)
    feed = {"input_ids": batch.input_ids, "attention_mask": (~batch.mask).astype(np.int64)}
    if "token_type_ids" in names:
        feed["token_type_ids"] = batch.token_type_ids
    hidden, pooled = session.run(None, feed)
    want, want_pooled = transformers_vectors(model_dirs[family], batch)
    keep = ~batch.mask
    assert np.abs(hidden - want)[keep].max() <= 4 * max(float32_floor(want), 1e-6)
    np.testing.assert_allclose(pooled, want_pooled, atol=1e-5)
    with pytest.raises(FileExistsError):
        interop.write(artifact, model_dirs[family], tmp_path / "st")


def test_export_prints_one_screen_and_no_progress_bars(model_dirs, tmp_path, capfd):
    """Issue 66: a summary by default (the table with -v, names never cut), nothing from a dependency's progress
    bars on either stream, errors only with -q. The default run as a user's terminal sees it, in its own process
    (where a dependency's progress bar would first show); -v and -q in this one, read at the file descriptors
    (their exports reuse this module's trace of the directory)."""
    argv = ["--from", str(model_dirs["bert"]), "--artifact", str(tmp_path / "a")]
    run = subprocess.run(
        [sys.executable, "-m", "addnorm.export.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    plain = capfd.readouterr()._replace(out=run.stdout, err=run.stderr)
    assert cli.main([*argv, "-v"]) == 0
    verbose = capfd.readouterr()
    assert cli.main([*argv, "-q"]) == 0
    quiet = capfd.readouterr()
    for r in (plain, verbose, quiet):
        assert "Loading weights" not in r.out + r.err and "it/s]" not in r.out + r.err
    assert len(plain.out.splitlines()) <= 8 and "PASSED" in plain.out and "wrote" in plain.out
    assert quiet.out == quiet.err == ""
    words = {w for line in verbose.out.splitlines() for w in line.split()}
    layers = Manifest.load(tmp_path / "a").config.num_layers
    assert {f"add_norm_{i}" for i in range(2 * layers)} <= words  # every step, by its whole name


def _exported(directory: Path, out: Path, variant: str, capsys) -> Manifest:
    """``directory`` exported as ``variant`` into ``out`` (the CLI's error on failure): its manifest."""
    args = ["--from", str(directory), "--artifact", str(out), "--variant", variant, "-q"]
    assert cli.main(args) == 0, capsys.readouterr().err
    return Manifest.load(out)


# (family, labels, variant): a cross-encoder (one label) of every family in fp32, classifiers in the lossy variants
HEADS = [(f, 1, "fp32") for f in FAMILIES] + [("bert", 3, "int8"), ("distilbert", 3, "fp16")]


def test_a_cross_encoders_head_with_the_wrong_activation_is_refused_by_its_ranking(
    tmp_path, monkeypatch, capsys
):
    """A head mapped with another activation than its model's (ELECTRA's GELU computed as tanh, BERT's) gives
    scores whose plain cosine with transformers' passes (their common offset: 0.99999 for relu, where the ranking's
    Spearman was 0.93); their cosine about their mean does not, and the export is refused saying so."""
    import dataclasses

    from addnorm.export.families import electra

    directory = make_model_dir("electra", tmp_path / "model", seed=7, labels=1)
    monkeypatch.setattr(electra, "FAMILY", dataclasses.replace(electra.FAMILY, head_activation="tanh"))
    assert cli.main(["--from", str(directory), "--artifact", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "classification head's scores do not match" in err and "scores centered cosine" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, labels, variant", HEADS)
def test_a_classification_head_exports_with_its_model_and_scores_as_transformers(
    tmp_path, family, labels, variant, capsys
):
    """*ForSequenceClassification's head (config.json's architectures) is part of the one graph, gated with the
    block, and scores text as transformers' model does: its logits within float32's floor for fp32 (the ranking
    and the top label the same in every variant); the manifest names the labels."""
    import torch
    from transformers import AutoModelForSequenceClassification

    directory = make_model_dir(family, tmp_path / "model", seed=7, labels=labels)
    out = tmp_path / "artifact"
    manifest = _exported(directory, out, variant, capsys)
    config = manifest.config
    assert (config.head, config.num_labels) == ("classify", labels)
    assert config.head_activation == {"distilbert": "relu", "electra": "gelu"}.get(family, "tanh")
    assert manifest.labels == tuple(f"label_{i}" for i in range(labels))
    assert [o.name for o in manifest.outputs] == [ENCODED, "scores"]
    reference = manifest.parity["reference"]["ids"]["graph"]
    assert reference["scores_cosine"] > 0.999
    if (
        labels == 1
    ):  # a cross-encoder's ranking of documents for a query, against transformers on the same pairs
        pairs = manifest.parity["reference"]["ids"]["pairs"]
        assert pairs["scores_spearman"] >= 0.99 and pairs["top3_overlap"] == 1.0, pairs
    batch = TextTokenizer((out / TOKENIZER_FILE).read_bytes(), manifest.text).encode(TEXTS, truncate=True)
    got = hf.run_ids(out, config, batch)["scores"]
    model = AutoModelForSequenceClassification.from_pretrained(str(directory), attn_implementation="eager")
    with torch.no_grad():
        want = model.eval()(**hf.feed(batch, manifest.text)).logits.double().numpy()
    assert (
        np.abs(want).max() > 0.1
    )  # logits of units (tests/text_models.py scales the head): a wrong head shows
    if variant == "fp32":
        assert np.abs(got - want).max() <= 4 * max(float32_floor(want), 1e-6), np.abs(got - want).max()
        assert (np.argsort(got[:, 0]) == np.argsort(want[:, 0])).all()
    else:
        assert np.abs(got - want).max() < 0.01 * np.abs(want).max()
        assert (got.argmax(1) == want.argmax(1)).all()


def test_head_none_exports_a_classifiers_encoder_and_a_head_needs_its_weights(model_dirs, tmp_path, capsys):
    classifier = make_model_dir("bert", tmp_path / "classifier", labels=2)
    out = tmp_path / "encoder"
    assert cli.main(["--from", str(classifier), "--artifact", str(out), "--head", "none", "-q"]) == 0
    assert Manifest.load(out).config.head == "none" and not Manifest.load(out).labels
    args = ["--from", str(model_dirs["bert"]), "--artifact", str(tmp_path / "x"), "--head", "classify"]
    assert cli.main([*args, "--num-labels", "1"]) == 2
    err = capsys.readouterr().err
    assert "classifier.weight" in err and "--task embed exports the encoder alone" in err


# (family, pooling, variant): a SPLADE model of every family in fp32, and int8 (fp16 keeps the head in float as
# int8 does, its block's tolerance is the embedders'); SpladePooling's sum: tests/model/test_sparse_head.py
SPARSE = [(f, "max", "fp32") for f in FAMILIES] + [("bert", "max", "int8")]


@pytest.mark.parametrize("family, pooling, variant", SPARSE)
def test_a_sparse_encoder_exports_with_its_masked_lm_head_and_weighs_terms_as_transformers(
    tmp_path, family, pooling, variant, capsys
):
    """A SparseEncoder's directory (modules.json: SpladePooling) exports with *ForMaskedLM's head in the one graph,
    gated with the block: its weights equal SpladePooling of transformers' logits on the same ids, the same non-zero
    terms and values within float32's floor for fp32; the lossy variants keep nearly every term."""
    import torch
    from transformers import AutoModelForMaskedLM

    from addnorm.export.agreement import splade

    directory = make_model_dir(family, tmp_path / "model", seed=9, sparse=pooling)
    out = tmp_path / "artifact"
    manifest = _exported(directory, out, variant, capsys)
    config = manifest.config
    assert (config.head, config.task, config.sparse_pooling, config.pooling) == (
        "sparse",
        "sparse",
        pooling,
        "none",
    )
    assert config.vocab_size == manifest.text.vocab_size and not manifest.labels
    assert [o.name for o in manifest.outputs] == [ENCODED, "sparse_weights"]
    reference = manifest.parity["reference"]["ids"]["graph"]
    assert reference["sparse_min_cosine"] > 0.999 and reference["sparse_nonzero"] > 0, reference
    batch = TextTokenizer((out / TOKENIZER_FILE).read_bytes(), manifest.text).encode(TEXTS, truncate=True)
    got = hf.run_ids(out, config, batch)["sparse_weights"]
    model = AutoModelForMaskedLM.from_pretrained(str(directory), attn_implementation="eager").eval()
    with torch.no_grad():
        want = splade(model(**hf.feed(batch, manifest.text)).logits.double().numpy(), batch.mask, pooling)
    nonzero = (want > 0).sum(1)
    assert (nonzero > 0).all() and (
        nonzero < want.shape[1]
    ).all()  # sparse answers: a wrong bias or mask shows
    if variant == "fp32":
        assert ((got > 0) == (want > 0)).all()
        assert np.abs(got - want).max() <= 4 * max(float32_floor(want), 1e-6), np.abs(got - want).max()
    else:  # terms near zero may come and go; the weights that matter stay
        assert ((got > 0) == (want > 0)).mean() > 0.97
        assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_task_picks_or_refuses_a_directorys_head(model_dirs, tmp_path, capsys):
    """--task: what the model answers, read from the directory; a head the checkpoint lacks is an error naming it."""
    splade_dir = make_model_dir("bert", tmp_path / "splade", seed=2, sparse="sum")
    assert model_dir.sentence_pooling(splade_dir)["sparse_pooling"] == "sum"  # SpladePooling's own config
    classifier = make_model_dir("bert", tmp_path / "clf", labels=3)
    out = tmp_path / "tokens"
    assert cli.main(["--from", str(splade_dir), "--artifact", str(out), "--task", "tokens", "-q"]) == 0
    config = Manifest.load(out).config
    assert (config.head, config.pooling, config.task) == ("none", "none", "embed")
    for directory, task, words in (
        (model_dirs["bert"], "sparse", "cls.predictions.transform.dense.weight"),
        (model_dirs["bert"], "classify", "needs a *ForSequenceClassification checkpoint"),
        (classifier, "rerank", "head has 3 label(s); a cross-encoder (--task rerank) has one"),
    ):
        args = ["--from", str(directory), "--artifact", str(tmp_path / task), "--task", task, "-q"]
        assert cli.main(args) == 2
        assert words in capsys.readouterr().err
    assert cli.main(["--artifact", str(tmp_path / "x"), "--task", "sparse", "-q"]) == 2
    assert "--task reads a model directory's head (--from DIR)" in capsys.readouterr().err
