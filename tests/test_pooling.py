"""Sentence embeddings (issue 34, item 8): ``--pooling mean|cls`` (``--normalize``) adds a ``pooled`` output
[batch, d_model] beside ``encoded``, computed as sentence-transformers computes it, gated like every output (the
numpy float64 oracle computes it too), cut per request by the batcher, and answered by /v1, V2 HTTP and gRPC.
The real checkpoint's pooled answers against sentence-transformers itself: tests/test_real_model.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from addnorm.export import cli as export_cli
from addnorm.export.gate import ParityError
from addnorm.model import encoder as torch_encoder
from addnorm.model import reference
from addnorm.model.artifact import load_verified
from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.contract import ENCODED, POOLED, io_specs, output_names
from addnorm.service.backend.engine import Engine
from addnorm.service.batching.batcher import Batcher
from bench.server import ServerProcess
from tests.conftest import SMALL, export_to
from tests.service.test_batcher import Recorder, until

pytestmark = [pytest.mark.export, pytest.mark.server]

MEAN = dataclasses.replace(SMALL, num_layers=2, pooling="mean", normalize_pooled=True)
CLS = dataclasses.replace(SMALL, pooling="cls", batch_first=False)


def _tokens(rng: np.random.Generator, b: int = 4, s: int = 7, e: int = 16) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((b, s, e))
    mask = np.zeros((b, s), bool)
    mask[1, 3:] = True
    mask[2, 1:] = True
    return x, mask


@pytest.mark.parametrize("how", ["mean", "cls"])
@pytest.mark.parametrize("normalize", [False, True])
def test_pooling_is_sentence_transformers_own_arithmetic(how, normalize):
    """model.encoder.pool (what the graph computes) and model.reference.pool (the numpy oracle) against
    sentence-transformers' Pooling and Normalize modules on the same token embeddings and attention mask."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    x, mask = _tokens(np.random.default_rng(0))
    features = {
        "token_embeddings": torch.from_numpy(x),
        "attention_mask": torch.from_numpy((~mask).astype(np.int64)),
    }
    st = Pooling(x.shape[-1], pooling_mode=how)(features)
    if normalize:
        st = Normalize()(st)
    want = st["sentence_embedding"].numpy()
    ours = torch_encoder.pool(torch.from_numpy(x), torch.from_numpy(mask), how, normalize).numpy()
    config = dataclasses.replace(SMALL, pooling=how, normalize_pooled=normalize)
    numpy_ours = reference.pool(config, x, mask)
    np.testing.assert_allclose(ours, want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(numpy_ours, want, rtol=1e-12, atol=1e-15)
    if how == "mean":  # padding never counts: row 2 is its first token alone
        assert not np.allclose(ours[1], x[1].mean(0) / (np.linalg.norm(x[1].mean(0)) if normalize else 1))


def test_the_contract_and_the_config_say_what_pooling_adds():
    assert output_names(SMALL) == (ENCODED,) and output_names(MEAN) == (ENCODED, POOLED)
    _, outputs = io_specs(CLS)
    assert [(o.name, o.shape) for o in outputs] == [
        (ENCODED, ("seq", "batch", 64)),
        (POOLED, ("batch", 64)),  # one row per sequence in every layout
    ]
    with pytest.raises(ConfigError, match="pooling must be one of"):
        dataclasses.replace(SMALL, pooling="max")
    with pytest.raises(ConfigError, match="normalize_pooled needs a pooling"):
        dataclasses.replace(SMALL, normalize_pooled=True)
    old = {k: v for k, v in SMALL.to_dict().items() if k not in ("pooling", "normalize_pooled")}
    assert EncoderConfig.from_dict(old).pooling == "none"  # manifests written before pooling load unchanged


def test_the_cli_refuses_normalize_without_pooling(tmp_path, capsys):
    code = export_cli.main(
        ["--artifact", str(tmp_path / "a"), "--d-model", "32", "--nhead", "4", "--normalize"]
    )
    assert code == 2 and "normalize_pooled needs a pooling" in capsys.readouterr().err
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_a_pooling_that_counts_padding_is_refused_by_the_gate(tmp_path, monkeypatch):
    """The graph and torch share model.encoder.pool; the numpy oracle does not: a torch pooling that averages over
    padding too (the classic mistake) disagrees with it, and nothing is exported."""

    def over_padding(tokens, mask, how, normalize):
        return tokens.sum(1) / tokens.shape[1]

    monkeypatch.setattr(torch_encoder, "pool", over_padding)
    with pytest.raises(ParityError, match="the float64 oracles disagree"):
        export_to(tmp_path / "wrong", dataclasses.replace(MEAN, normalize_pooled=False))
    assert not (tmp_path / "wrong" / "manifest.json").exists()


@pytest.fixture(scope="module")
def pooled_artifacts(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer mean-pooled, normalized fp32 model, and a cls-pooled --no-batch-first int8 one."""
    root = tmp_path_factory.mktemp("pooled")
    shape = ["--d-model", "64", "--nhead", "4", "--dim-feedforward", "128", "--num-layers", "2"]
    flags = ["--pooling", "mean", "--normalize", "--name", "mean", "-q"]  # as the README's command
    assert export_cli.main(["--artifact", str(root / "mean"), *shape, *flags]) == 0
    assert load_verified(root / "mean")[0].config == dataclasses.replace(MEAN, dropout=0.1)
    return {"mean": root / "mean", "cls": export_to(root / "cls", CLS, name="cls", variant="int8")}


def test_the_gate_judges_the_pooled_output_and_keeps_it_in_the_golden_data(pooled_artifacts):
    from addnorm.model.golden import load_golden

    for name, directory in pooled_artifacts.items():
        manifest, _ = load_verified(directory)
        assert [o.name for o in manifest.outputs] == [ENCODED, POOLED], name
        cases = json.loads((directory / "manifest.json").read_text())["parity"]
        assert cases["passed"], name
        golden = load_golden(directory / "golden.safetensors")
        assert all(c[f"torch.{POOLED}"].shape == (c["embeddings"].shape[0], 64) for c in golden.values())


def test_merged_requests_of_different_lengths_each_get_their_own_pooled_rows(pooled_artifacts):
    """The batcher pads merged requests to the longest; a pooled output has no positions to cut: each request gets
    its rows, equal to the request run alone (both layouts: the cls model's graph is sequence-first)."""
    rng = np.random.default_rng(1)
    for name, directory in pooled_artifacts.items():
        engine = Engine(directory, "cpu", intra_op_threads=1)
        reqs = [(rng.standard_normal((1 + i % 2, 2 + 3 * i, 64)).astype(np.float32), None) for i in range(5)]
        gate = threading.Event()
        model = Recorder(engine, gate)

        async def main(model=model, gate=gate, reqs=reqs):
            batcher = Batcher(model, max_batch_size=64, max_batch_tokens=10_000, max_queue_delay_ms=50)
            batcher.start()
            tasks = [asyncio.ensure_future(batcher.infer(x, m)) for x, m in reqs]
            await until(model.entered.is_set)
            gate.set()
            results = await asyncio.gather(*tasks)
            await batcher.stop()
            return results

        results = asyncio.run(main())
        assert len(model.shapes) < len(reqs), model.shapes  # merged
        for (x, _), (out, _) in zip(reqs, results, strict=True):
            alone = engine.run(x)
            assert out[POOLED].shape == (x.shape[0], 64) and out[ENCODED].shape == x.shape
            np.testing.assert_allclose(out[POOLED], alone[POOLED], atol=1e-5, rtol=1e-4)
        if name == "mean":
            norms = np.linalg.norm(np.concatenate([out[POOLED] for out, _ in results]), axis=1)
            np.testing.assert_allclose(norms, 1.0, rtol=1e-5)


@pytest.fixture(scope="module")
def server(pooled_artifacts) -> Iterator[ServerProcess]:
    args = ["-m", "addnorm.service", "--live-parity-rate", "1", "--max-queue-delay-ms", "1"]
    for directory in pooled_artifacts.values():
        args += ["--artifact", str(directory)]
    with ServerProcess(args, grpc=True) as srv:
        yield srv


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_every_transport_answers_the_pooled_output(server, pooled_artifacts):
    """/v1 JSON (ragged sequences: one pooled row each, nothing cut; one sequence: one row), V2 HTTP and gRPC
    through tritonclient (requested by name, as Triton's clients ask), the metadata and model config, and live
    parity judging every output of every sampled answer."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    rng = np.random.default_rng(2)
    lengths = [3, 9, 5]
    seqs = [rng.standard_normal((n, 64)).astype(np.float32) for n in lengths]
    x = np.zeros((3, 9, 64), np.float32)
    mask = np.ones((3, 9), bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)], mask[i, : len(s)] = s, False
    http = th.InferenceServerClient(f"127.0.0.1:{server.port}")
    grpc = tg.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for name, directory in pooled_artifacts.items():
        want = Engine(directory, "cpu", intra_op_threads=1).run(x, mask)[POOLED]
        v1 = _post(server.base + "/v1/encode", {"model": name, "embeddings": [s.tolist() for s in seqs]})
        assert [len(e) for e in v1[ENCODED]] == lengths
        answers = {"v1": np.asarray(v1[POOLED], np.float32)}
        one = _post(server.base + "/v1/encode", {"model": name, "embeddings": seqs[1].tolist()})
        assert np.asarray(one[POOLED]).shape == (64,) and np.asarray(one[ENCODED]).shape == (9, 64)
        np.testing.assert_allclose(one[POOLED], want[1], atol=1e-5, rtol=1e-4)
        for client, mod, key in ((http, th, "v2"), (grpc, tg, "grpc")):
            inputs = [
                mod.InferInput("embeddings", list(x.shape), "FP32"),
                mod.InferInput("mask", [3, 9], "BOOL"),
            ]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(mask)
            result = client.infer(name, inputs, outputs=[mod.InferRequestedOutput(POOLED)])
            assert result.as_numpy(ENCODED) is None  # only what was asked for
            answers[key] = result.as_numpy(POOLED)
        for how, got in answers.items():
            assert got.shape == (3, 64), (name, how)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=f"{name} over {how}")
        meta = http.get_model_metadata(name)
        assert {o["name"]: o["shape"] for o in meta["outputs"]} == {ENCODED: [-1, -1, 64], POOLED: [-1, 64]}
        config = grpc.get_model_config(name).config
        assert [list(o.dims) for o in config.output] == [[-1, 64], [64]]
    model = _get(server.base + "/v1/model?model=mean")
    assert model["config"]["pooling"] == "mean" and model["config"]["normalize_pooled"] is True
    for name in pooled_artifacts:  # 4 answers each, every one offered to live parity (checked or dropped)
        deadline = time.monotonic() + 120
        while sum((live := _get(f"{server.base}/v1/model?model={name}")["live_parity"])[k] for k in SEEN) < 4:
            assert time.monotonic() < deadline, live
            time.sleep(0.1)
        assert live["checked"] >= 1 and live["failed"] == 0, (name, live)


SEEN = ("checked", "dropped")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], ("mean", True)),  # the directory's pipeline
        (["--pooling", "cls"], ("cls", True)),
        (["--no-normalize"], ("mean", False)),
        (["--pooling", "none"], ("none", False)),  # encoded alone: nothing left to normalize
    ],
)
def test_flags_change_a_sentence_transformers_directorys_pooling(flags, want):
    args = export_cli.build_parser().parse_args(["--artifact", "x", "--from-bert", "d", *flags])
    fields = {"d_model": 64, "nhead": 4, "dim_feedforward": 128, "num_layers": 1}
    config = export_cli.config_from_args(args, fields, None, {"pooling": "mean", "normalize_pooled": True})
    assert (config.pooling, config.normalize_pooled) == want


def test_v1_answers_one_output_when_asked(server, pooled_artifacts):
    """?output=pooled: a binary answer (npy, raw) carries the sentence embeddings, a JSON one them alone; an output
    no model has, or one this model lacks, is a 400 naming it."""
    import io

    from addnorm.service.errors import BadInput
    from addnorm.service.protocols.v1 import codec

    rng = np.random.default_rng(3)
    seqs = [rng.standard_normal((n, 64)).astype(np.float32) for n in (4, 7)]
    x = np.zeros((2, 7, 64), np.float32)
    mask = np.ones((2, 7), bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)], mask[i, : len(s)] = s, False
    want = Engine(pooled_artifacts["mean"], "cpu", intra_op_threads=1).run(x, mask)[POOLED]
    body = json.dumps({"model": "mean", "embeddings": [s.tolist() for s in seqs]}).encode()
    url = server.base + "/v1/encode?output=pooled"
    for accept in ("application/x-npy", "application/octet-stream", "application/json"):
        req = urllib.request.Request(url, body, {"content-type": "application/json", "accept": accept})
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, shape = r.read(), r.headers.get("X-Shape")
            assert r.headers.get("X-Lengths") is None  # one row per sequence: nothing to cut
        if accept == "application/json":
            doc = json.loads(raw)
            assert set(doc) == {POOLED, "shape", "model"} and doc["shape"] == [2, 64], doc.keys()
            got = np.asarray(doc[POOLED], np.float32)
        elif accept == "application/x-npy":
            got = np.load(io.BytesIO(raw))
        else:
            assert shape == "2,64"
            got = np.frombuffer(raw, "<f4").reshape(2, 64)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=accept)
    for bad in ("bogus", ""):
        req = urllib.request.Request(
            server.base + f"/v1/encode?output={bad}", body, {"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 400 and "output" in json.loads(refused.value.read())["error"]
    decoded = codec.EncodeRequest(x, mask)
    with pytest.raises(BadInput, match="has no output 'pooled'"):
        codec.encode(decoded, {ENCODED: x}, codec.NPY, "plain", POOLED)
