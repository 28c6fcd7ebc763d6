"""ModernBERT (export/families/modernbert.py) on the one encoder block: rotary positions (a base for global layers
and one for local ones), local layers' attention windows, no biases, no first attention norm, a gated GELU
feed-forward and a final norm. The torch block equals the float64 oracle (model/reference.py) and transformers' own
ModernBERT layers; a tiny random ModernBertModel's directory, built with transformers, exports with its embedding
layer (a norm of the token's embedding, no position table) and its text through the graphs equals transformers'
ModernBertModel and sentence-transformers' pooling, in fp32 at float32's floor and in the lossy variants within
their tolerance, past the window so that it matters."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from addnorm.export import cli
from addnorm.model import reference
from addnorm.model.artifact import Manifest
from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.contract import ENCODED, POOLED
from addnorm.model.encoder import Packing, build_encoder
from addnorm.model.text import TOKENIZER_FILE
from addnorm.model.tokenize import TextTokenizer
from tests.text_models import MODERN, TEXTS, assert_like_transformers, make_model_dir

pytestmark = [pytest.mark.export, pytest.mark.usefixtures("one_trace_per_model")]


def test_the_modern_block_equals_the_float64_oracle():
    config = EncoderConfig(**MODERN)
    encoder = build_encoder(config).double()
    assert not any(k.endswith("bias") for k in encoder.state_dict())  # none anywhere
    assert (
        "layers.0.norm1.weight" not in encoder.state_dict()
        and "layers.1.norm1.weight" in encoder.state_dict()
    )
    assert [config.is_local(i) for i in range(3)] == [False, True, True]
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, 13:] = True
    with torch.no_grad():
        got = encoder(x, mask).numpy()
    weights = {k: v.numpy() for k, v in encoder.state_dict().items()}
    want = reference.forward(config, weights, x.numpy(), mask.numpy())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # packed: the two rows end to end at their own lengths (20 and 13): each sequence's positions from 0
    tokens = torch.cat([x[0], x[1, :13]])[None]
    packing = Packing(torch.tensor([0, 20]), torch.tensor([20, 13]), 20, torch.zeros(33, dtype=torch.bool))
    with torch.no_grad():
        packed = encoder.packed_outputs(tokens, packing)[ENCODED].numpy()
    np.testing.assert_allclose(packed[0], want[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(packed[1, :13], want[1, :13], rtol=0, atol=1e-12)
    # each part can fail: no window, no rotation, or a norm before the first attention answers otherwise
    for change in ({"attention_window": 0}, {"rotary_theta": 0.0, "rotary_theta_local": 0.0}):
        other = reference.forward(EncoderConfig(**{**MODERN, **change}), weights, x.numpy(), mask.numpy())
        assert np.abs(other - want)[~mask.numpy()].max() > 1e-3, change


def test_a_modern_block_refuses_what_it_cannot_compute():
    with pytest.raises(ConfigError, match="first_attention_norm false needs norm_first"):
        EncoderConfig(**{**MODERN, "norm_first": False})
    with pytest.raises(ConfigError, match="both set"):
        EncoderConfig(**{**MODERN, "rotary_theta_local": 0.0})
    with pytest.raises(ConfigError, match="head width 3 is odd"):
        EncoderConfig(**{**MODERN, "d_model": 12, "nhead": 4})


PROMPTS = {"query": "search_query: ", "document": "search_document: "}  # modernbert-embed's


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    d = make_model_dir("modernbert", tmp_path_factory.mktemp("modernbert") / "model", seed=5)
    (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return d


@pytest.fixture(scope="module")
def exported(directory, tmp_path_factory):
    """Export each variant once (the fp32 artifact is also the one served below): variant -> its directory."""
    root, done = tmp_path_factory.mktemp("exported"), {}

    def export(variant: str):
        if variant not in done:
            out = root / variant
            args = [
                "--from",
                str(directory),
                "--artifact",
                str(out),
                "--variant",
                variant,
                "--name",
                "modern",
            ]
            assert cli.main([*args, "-q"]) == 0
            done[variant] = out
        return done[variant]

    return export


@pytest.mark.parametrize("variant", ["fp32", "fp16", "int8"])
def test_modernbert_exports_and_its_text_equals_transformers(directory, exported, variant):
    out = exported(variant)
    manifest = Manifest.load(out)
    config, text = manifest.config, manifest.text
    assert (text.family, text.positions, text.norm_bias, config.attention_window) == (
        "modernbert",
        "none",
        False,
        4,
    )
    assert (config.global_every, config.rotary_theta, config.rotary_theta_local) == (3, 160_000.0, 10_000.0)
    batch = TextTokenizer((out / TOKENIZER_FILE).read_bytes(), text).encode(TEXTS, truncate=True)
    assert max(batch.lengths) > 2 * config.attention_window + 1  # the window decides some keys
    assert_like_transformers(out, config, batch, directory, variant)


@pytest.mark.server
def test_a_served_modernbert_answers_what_sentence_transformers_computes(directory, exported):
    """The official openai client, TEI's /embed and V2 through tritonclient (HTTP and gRPC) on a tiny ModernBERT
    embedder, with mixed lengths (some past the window, one cut to the model's length) against
    sentence-transformers' SentenceTransformer on the same directory."""
    import httpx
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    from tests.conftest import start_server

    out = exported("fp32")
    texts = [*TEXTS, " ".join(TEXTS)]
    want = SentenceTransformer(str(directory), device="cpu").encode(texts)  # its own cut at max_seq_length
    with start_server(out, grpc=True) as srv:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model="modern", input=texts, extra_body={"truncate": True})
        np.testing.assert_allclose([d.embedding for d in answer.data], want, atol=2e-6)
        tei = httpx.post(f"{srv.base}/embed", json={"inputs": texts, "truncate": True}).json()
        np.testing.assert_allclose(tei, want, atol=2e-6)
        for module, url in (
            (httpclient, srv.base.removeprefix("http://")),
            (grpcclient, f"127.0.0.1:{srv.grpc_port}"),
        ):
            text = module.InferInput("text", [len(TEXTS), 1], "BYTES")
            text.set_data_from_numpy(np.array([[t.encode()] for t in TEXTS], dtype=object))
            got = module.InferenceServerClient(url).infer("modern", [text]).as_numpy(POOLED)
            np.testing.assert_allclose(got, want[: len(TEXTS)], atol=2e-6)
        _prompts_truncation_and_quantized_forms(srv, directory, out, texts)


@pytest.mark.server
def test_long_inputs_served_through_the_banded_window_equal_sentence_transformers(tmp_path):
    """Past BANDED_FROM (512) positions the local layers run their window in blocks (export/attention.py): a tiny
    ModernBERT of 1,024 positions serves texts cut at 1,024 tokens, one of about 700 and a short one in one request,
    through the official openai client and TEI's /embed (left truncation too), equal to sentence-transformers."""
    import httpx
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    from addnorm.model.attention import BANDED_FROM
    from tests.conftest import start_server

    directory = make_model_dir("modernbert", tmp_path / "model", seed=5, max_positions=1024)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024}))
    out = tmp_path / "artifact"
    assert cli.main(["--from", str(directory), "--artifact", str(out), "--name", "modern", "-q"]) == 0
    words = "the quick brown fox jumps over the lazy dog and keeps running far away "
    texts = [words * 25, "a short query", words[:-1] * 14]  # about 1,250, 13 and 700 tokens
    model = SentenceTransformer(str(directory), device="cpu")
    lengths = [len(model.tokenizer(t)["input_ids"]) for t in texts]
    assert lengths[0] > 1024 and BANDED_FROM < lengths[2] < 1024, lengths
    want = model.encode(texts)
    with start_server(out) as srv:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model="modern", input=texts)
        np.testing.assert_allclose([d.embedding for d in answer.data], want, atol=2e-6)
        model.tokenizer.truncation_side = "left"
        left = httpx.post(
            f"{srv.base}/embed", json={"inputs": texts, "truncation_direction": "Left"}, timeout=60
        )
        np.testing.assert_allclose(left.json(), model.encode(texts), atol=2e-6)


def _prompts_truncation_and_quantized_forms(srv, directory, artifact, texts) -> None:
    """The official cohere client's /v2/embed and V2 on the served ModernBERT: its prompts as
    sentence-transformers' encode_query and encode_document put them, truncation at either end, and every quantized
    form exactly sentence-transformers' quantize_embeddings of the served vectors with the artifact's ranges."""
    import cohere
    import tritonclient.http as httpclient
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util.quantization import quantize_embeddings

    from addnorm.model import quantize

    model = SentenceTransformer(str(directory), device="cpu")
    co = cohere.ClientV2(base_url=srv.base, api_key="unused")
    forms = ["float", *quantize.PRECISIONS]
    query = co.embed(model="modern", texts=texts, input_type="search_query", embedding_types=forms).embeddings
    floats = np.array(query.float_, np.float32)
    np.testing.assert_allclose(floats, model.encode_query(texts), atol=2e-6)
    calibration = quantize.load((artifact / quantize.CALIBRATION_FILE).read_bytes())
    for precision in quantize.PRECISIONS:
        ranges = quantize.ranges(calibration, None, True)
        want = quantize_embeddings(floats, precision, ranges=ranges)
        np.testing.assert_array_equal(np.array(getattr(query, precision), want.dtype), want)
    model.tokenizer.truncation_side = "left"
    start = co.embed(model="modern", texts=texts, input_type="search_document", truncate="START")
    np.testing.assert_allclose(start.embeddings.float_, model.encode_document(texts), atol=2e-6)
    client = httpclient.InferenceServerClient(srv.base.removeprefix("http://"))
    text = httpclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    params = {"prompt_name": "query", "embedding_type": "ubinary", "truncation_direction": "left"}
    got = client.infer("modern", [text], parameters=params).as_numpy(POOLED)
    np.testing.assert_array_equal(got, quantize_embeddings(model.encode_query(texts), "ubinary"))


def test_a_modernbert_head_is_refused_by_name_and_its_encoder_exports(tmp_path, capsys):
    """ModernBERT's heads (its prediction head's dense, activation and norm before a classifier) are not mapped:
    its classifier directory is refused saying so, and --task embed exports the encoder under it."""
    classifier = make_model_dir("modernbert", tmp_path / "clf", labels=2)
    assert cli.main(["--from", str(classifier), "--artifact", str(tmp_path / "a"), "-q"]) == 2
    assert "ModernBERT's classification head is not mapped" in capsys.readouterr().err
    assert (
        cli.main(["--from", str(classifier), "--artifact", str(tmp_path / "b"), "--task", "embed", "-q"]) == 0
    )
    assert Manifest.load(tmp_path / "b").config.head == "none"
