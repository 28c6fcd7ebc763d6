"""A SPLADE model (a tiny random BertForMaskedLM with sentence-transformers' SpladePooling, built with transformers and
exported with its masked-LM head) served by a real server: TEI's /embed_sparse equal to sentence-transformers'
SparseEncoder.encode (the same non-zero terms, values within float32's spread) on real text of mixed lengths, V2's
``sparse_weights`` output over HTTP and gRPC with tritonclient, /info's kind; every bad input a 4xx naming it, a request for a
task the model lacks included, and the server serving on."""

from __future__ import annotations

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
# real text of mixed lengths, the last past the model's 48 tokens (cut with truncate)
INPUTS = [*TEXTS, " ".join(TEXTS) * 2]
GRPC_PORT = 0  # the server's, set by its fixture


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return make_model_dir("bert", tmp_path_factory.mktemp("splade") / "model", seed=11, sparse="max")


@pytest.fixture(scope="module")
def splade(directory, tmp_path_factory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("artifact") / "splade"
    assert cli.main(["--from", str(directory), "--artifact", str(out), "--name", "splade", "-q"]) == 0
    with start_server(out, "--max-client-batch-size", "40", grpc=True) as srv:
        global GRPC_PORT
        GRPC_PORT = srv.grpc_port
        yield srv.base


def _sparse_encoder(directory: Path) -> np.ndarray:
    """sentence-transformers' SparseEncoder on INPUTS (its own truncation at the directory's max_seq_length), dense."""
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(directory), device="cpu", local_files_only=True)
    return model.encode(INPUTS, convert_to_tensor=True).to_dense().double().numpy()


def _dense(rows: list[list[dict]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width))
    for i, row in enumerate(rows):
        index = [v["index"] for v in row]
        assert index == sorted(index) and len(set(index)) == len(index)  # ascending, each term once
        out[i, index] = [v["value"] for v in row]
    return out


def test_tei_embed_sparse_equals_sentence_transformers_sparse_encoder(splade, directory):
    want = _sparse_encoder(directory)
    rows = httpx.post(f"{splade}/embed_sparse", json={"inputs": INPUTS, "truncate": True}).json()
    got = _dense(rows, want.shape[1])
    assert ((got != 0) == (want != 0)).all()  # the same terms: what a sparse index stores
    terms = (want != 0).sum(1)
    assert terms.min() > 0 and terms.max() < want.shape[1]  # sparse answers, neither empty nor full
    np.testing.assert_allclose(got, want, atol=1e-6)
    one = httpx.post(f"{splade}/embed_sparse", json={"inputs": INPUTS[0]}).json()
    assert len(one) == 1  # one text: a list of one, as TEI answers
    assert [v["index"] for v in one[0]] == [v["index"] for v in rows[0]]
    np.testing.assert_allclose(_dense(one, want.shape[1])[0], got[0], atol=1e-6)


def test_v2_answers_sparse_weights_over_http_and_grpc_with_tritonclient(splade, directory):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    want = _sparse_encoder(directory)[:4]
    for module, url in (
        (httpclient, splade.removeprefix("http://")),
        (grpcclient, f"127.0.0.1:{GRPC_PORT}"),
    ):
        client = module.InferenceServerClient(url)
        text = module.InferInput("text", [4, 1], "BYTES")
        text.set_data_from_numpy(np.array([[t.encode()] for t in INPUTS[:4]], dtype=object))
        answer = client.infer("splade", [text], outputs=[module.InferRequestedOutput("sparse_weights")])
        np.testing.assert_allclose(answer.as_numpy("sparse_weights"), want, atol=1e-6)
    meta = httpx.get(f"{splade}/v2/models/splade").json()
    assert {"name": "sparse_weights", "datatype": "FP32", "shape": [-1, want.shape[1]]} in meta["outputs"]
    assert all(i["name"] != "query" for i in meta["inputs"])  # pairs are a classification head's


def test_tei_info_says_splade_pooling(splade):
    info = httpx.get(f"{splade}/info").json()
    assert info["model_id"] == "splade" and info["model_type"] == {"embedding": {"pooling": "splade"}}


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/embed_sparse", {}, 400, "missing field 'inputs'"),
        ("/embed_sparse", {"inputs": []}, 400, "inputs"),
        ("/embed_sparse", {"inputs": [[5, 999_999]]}, 400, "outside this model's vocabulary"),
        ("/embed_sparse", {"inputs": "a", "normalize": True}, 400, "unknown field(s) ['normalize']"),
        ("/embed_sparse", {"inputs": ["a"] * 41}, 413, "more than this server's 40"),
        ("/embed_sparse", {"inputs": "word " * 80, "truncate": False}, 413, "inputs[0] has"),
        ("/embed_sparse", {"inputs": "a", "truncation_direction": "Middle"}, 400, "truncation_direction"),
        ("/embed_sparse", {"inputs": "a", "prompt_name": "query"}, 400, "query"),
        (
            "/v1/embeddings",
            {"input": "a"},
            400,
            "'splade' is a sparse model; /v1/embeddings needs embed: ask it on /embed_sparse",
        ),
        ("/embed", {"inputs": "a"}, 400, "is a sparse model; /embed needs embed"),
        ("/rerank", {"query": "q", "texts": ["a"]}, 400, "is a sparse model; /rerank needs rerank"),
    ],
)
def test_every_bad_sparse_request_is_a_4xx_naming_it(splade, path, body, status, words):
    r = httpx.post(f"{splade}{path}", json=body)
    assert r.status_code == status, r.text
    assert words in error_message(r), error_message(r)
    assert httpx.get(f"{splade}/health/ready").status_code == 200
