"""Prompts and truncation as sentence-transformers and text-embeddings-inference define them, on a tiny random BERT
embedder whose config_sentence_transformers.json names prompts and a default one: a request's ``prompt_name`` or
``prompt``, the model's default, the server's --default-prompt-name / --default-prompt, the prompt's tokens counted
toward the length; ``truncation_direction`` Left keeping an input's end. Each served answer (the official openai
client, TEI's /embed, V2) equals SentenceTransformer.encode with the same prompt and truncation side."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from addnorm.export import cli
from tests.conftest import start_server
from tests.helpers import error_message
from tests.text_models import TEXTS, make_model_dir

pytestmark = pytest.mark.server
PROMPTS = {"query": "query: ", "document": "passage: "}
LONG = " ".join(TEXTS) * 2  # past the model's 48 tokens


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    d = make_model_dir("bert", tmp_path_factory.mktemp("prompts") / "model", seed=13)
    (d / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": PROMPTS, "default_prompt_name": "query"})
    )
    return d


@pytest.fixture(scope="module")
def artifact(directory, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifact") / "prompted"
    assert cli.main(["--from", str(directory), "--artifact", str(out), "--name", "prompted", "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def server(artifact) -> Iterator[str]:
    with start_server(artifact) as srv:
        yield srv.base


def _st(directory: Path, texts: list[str], side: str = "right", **prompt) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu")
    model.tokenizer.truncation_side = side
    return model.encode(texts, **prompt)


def test_prompts_equal_sentence_transformers(server, directory):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    default = _st(directory, TEXTS)  # the model's default_prompt_name: "query: "
    assert np.abs(default - _st(directory, TEXTS, prompt="")).max() > 1e-3  # the prompt matters
    got = [d.embedding for d in client.embeddings.create(model="prompted", input=TEXTS).data]
    np.testing.assert_allclose(got, default, atol=2e-6)
    for prompt, body in (
        ({"prompt_name": "document"}, {"prompt_name": "document"}),
        ({"prompt": "custom: "}, {"prompt": "custom: "}),
        ({"prompt": ""}, {"prompt": ""}),  # no prompt at all, asked for
    ):
        want = _st(directory, TEXTS, **prompt)
        tei = httpx.post(f"{server}/embed", json={"inputs": TEXTS, **body}).json()
        np.testing.assert_allclose(tei, want, atol=2e-6)
        openai = client.embeddings.create(model="prompted", input=TEXTS, extra_body=body).data
        np.testing.assert_allclose([d.embedding for d in openai], want, atol=2e-6)
    v2 = {
        "inputs": [{"name": "text", "shape": [len(TEXTS), 1], "datatype": "BYTES", "data": TEXTS}],
        "outputs": [{"name": "pooled"}],
        "parameters": {"prompt_name": "document"},
    }
    pooled = httpx.post(f"{server}/v2/models/prompted/infer", json=v2).json()["outputs"][0]["data"]
    np.testing.assert_allclose(
        np.reshape(pooled, (len(TEXTS), -1)), _st(directory, TEXTS, prompt_name="document"), atol=2e-6
    )


def test_cohere_input_types_pick_the_models_prompts_as_sentence_transformers_does(artifact, directory):
    """The official cohere client's /v2/embed: search_query is SentenceTransformer.encode_query, search_document
    encode_document (the model's "document" prompt), an input type the model has no prompt for its default;
    truncate START and END as sentence-transformers' truncation sides; V2 over gRPC (tritonclient) honours
    prompt_name as HTTP does."""
    import cohere
    import tritonclient.grpc as grpcclient
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu")
    with start_server(artifact, grpc=True) as srv:
        co = cohere.ClientV2(base_url=srv.base, api_key="unused")

        def embed(texts, input_type, **kw):
            answer = co.embed(model="prompted", texts=texts, input_type=input_type, **kw)
            return np.array(answer.embeddings.float_)

        np.testing.assert_allclose(embed(TEXTS, "search_query"), model.encode_query(TEXTS), atol=2e-6)
        np.testing.assert_allclose(embed(TEXTS, "search_document"), model.encode_document(TEXTS), atol=2e-6)
        np.testing.assert_allclose(embed(TEXTS, "clustering"), model.encode(TEXTS), atol=2e-6)
        for truncate, side in (("END", "right"), ("START", "left")):
            want = _st(directory, [LONG], side, prompt_name="document")
            np.testing.assert_allclose(embed([LONG], "search_document", truncate=truncate), want, atol=2e-6)
        with pytest.raises(cohere.core.ApiError) as refused:
            embed([LONG], "search_document", truncate="NONE")
        assert refused.value.status_code == 413 and "more than this model's 48" in str(refused.value.body)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        text = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
        for params in ({"prompt_name": "document"}, {"prompt": "custom: "}):
            answer = client.infer(
                "prompted", [text], outputs=[grpcclient.InferRequestedOutput("pooled")], parameters=params
            )
            np.testing.assert_allclose(answer.as_numpy("pooled"), _st(directory, TEXTS, **params), atol=2e-6)


def test_a_prompts_tokens_count_toward_the_length_and_left_truncation_keeps_the_end(server, directory):
    for side in ("Right", "Left"):
        want = _st(directory, [LONG], side.lower(), prompt_name="document")
        body = {"inputs": LONG, "prompt_name": "document", "truncate": True, "truncation_direction": side}
        np.testing.assert_allclose(httpx.post(f"{server}/embed", json=body).json(), want, atol=2e-6)
        body = {"input": LONG, "prompt_name": "document", "truncation_direction": side.lower()}  # /v1 too
        got = httpx.post(f"{server}/v1/embeddings", json=body).json()["data"][0]["embedding"]
        np.testing.assert_allclose(got, want[0], atol=2e-6)
    right = httpx.post(f"{server}/embed", json={"inputs": LONG, "truncate": True}).json()
    left = httpx.post(
        f"{server}/embed", json={"inputs": LONG, "truncate": True, "truncation_direction": "Left"}
    ).json()
    assert np.abs(np.subtract(right, left)).max() > 1e-3
    tokens = httpx.post(f"{server}/tokenize", json={"inputs": "a b", "prompt": "x y z "}).json()[0]
    assert [t["text"] for t in tokens if not t["special"]][:3] == ["x", "y", "z"]


def test_the_servers_default_prompt_and_its_errors(artifact, directory, server):
    with start_server(artifact, "--default-prompt-name", "document") as srv:
        got = httpx.post(f"{srv.base}/embed", json={"inputs": TEXTS}).json()
        np.testing.assert_allclose(got, _st(directory, TEXTS, prompt_name="document"), atol=2e-6)
    with start_server(artifact, "--default-prompt", "custom: ") as srv:
        got = httpx.post(f"{srv.base}/embed", json={"inputs": TEXTS}).json()
        np.testing.assert_allclose(got, _st(directory, TEXTS, prompt="custom: "), atol=2e-6)
    for path, body, words in (
        (
            "/embed",
            {"inputs": "a", "prompt_name": "nope"},
            "prompt_name 'nope' is not one of this model's prompts ['document', 'query']",
        ),
        (
            "/embed",
            {"inputs": "a", "prompt_name": "query", "prompt": "x"},
            "give prompt_name or prompt, not both",
        ),
        ("/embed", {"inputs": "a", "prompt": 3}, "prompt must be a string"),
        ("/embed", {"inputs": "a", "truncation_direction": "Up"}, "truncation_direction must be 'Right'"),
        ("/v1/embeddings", {"input": "a", "prompt_name": "nope"}, "is not one of this model's prompts"),
    ):
        r = httpx.post(f"{server}{path}", json=body)
        assert r.status_code == 400 and words in error_message(r), r.text
