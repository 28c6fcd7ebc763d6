"""A cross-encoder and a classifier (tiny random BERTs built with transformers, exported with their heads), served by
a real server: TEI's /rerank and /predict, the rerank API of Cohere (the official ``cohere`` client, v1 and v2) and
V2's scores output, each equal to sentence-transformers' CrossEncoder or transformers' text-classification pipeline
on the same texts and pairs; every bad input a 4xx in
its API's shape that names the problem, a request for a task the model lacks included."""

from __future__ import annotations

import base64
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from addnorm.export import cli
from addnorm.model.artifact import Manifest
from tests.conftest import start_server
from tests.helpers import error_message, run_schemathesis
from tests.text_models import TEXTS, make_model_dir

pytestmark = pytest.mark.server
QUERY = "A man is eating food."
# real text of mixed lengths, one past the model's 64 positions once paired with the query
DOCUMENTS = [*TEXTS, " ".join(TEXTS) * 2]
GRPC_PORT = 0  # the reranker's, set by its fixture
OTHER_FAMILIES = ("roberta", "distilbert", "mpnet", "electra")  # cross-encoders beside BERT's


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "ce": make_model_dir("bert", root / "ce", seed=3, labels=1),
        "clf": make_model_dir("bert", root / "clf", seed=4, labels=3),
        "emb": make_model_dir("bert", root / "emb", seed=5),
        # the other families' cross-encoders: pairs as their tokenizers write them (RoBERTa's </s></s>, no types)
        **{f: make_model_dir(f, root / f, seed=6, labels=1) for f in OTHER_FAMILIES},
    }


@pytest.fixture(scope="module")
def artifacts(dirs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("artifacts")
    for name, directory in dirs.items():
        assert cli.main(["--from", str(directory), "--artifact", str(out / name), "--name", name, "-q"]) == 0
    return {name: out / name for name in dirs}


@pytest.fixture(scope="module")
def reranker(artifacts) -> Iterator[str]:
    """The cross-encoder (the default model, TEI's routes' one) beside an embedder; small parts, few documents."""
    others = [arg for f in ("emb", *OTHER_FAMILIES) for arg in ("--artifact", str(artifacts[f]))]
    args = (*others, "--max-batch-tokens", "256", "--max-client-batch-size", "40")
    with start_server(artifacts["ce"], *args, grpc=True) as srv:
        global GRPC_PORT
        GRPC_PORT = srv.grpc_port
        yield srv.base


@pytest.fixture(scope="module")
def classifier(artifacts) -> Iterator[str]:
    with start_server(artifacts["clf"]) as srv:
        yield srv.base


def _cross_encoder(directory: Path, max_length: int = 64):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(directory), local_files_only=True, max_length=max_length)


def _identity():
    import torch

    return torch.nn.Identity()


def _by_index(ranks: list[dict], key: str) -> np.ndarray:
    out = np.full(len(ranks), np.nan)
    for rank in ranks:
        out[rank["index"]] = rank[key]
    return out


def test_tei_rerank_equals_sentence_transformers_cross_encoder(reranker, dirs):
    model = _cross_encoder(dirs["ce"])
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = model.predict(pairs)  # its sigmoid of the one logit
    body = {"query": QUERY, "texts": DOCUMENTS, "truncate": True, "return_text": True}
    ranks = httpx.post(f"{reranker}/rerank", json=body).json()
    got = _by_index(ranks, "score")
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert [r["score"] for r in ranks] == sorted(got, reverse=True)  # best first
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in ranks)
    raw = httpx.post(f"{reranker}/rerank", json={**body, "raw_scores": True, "return_text": False}).json()
    np.testing.assert_allclose(
        _by_index(raw, "score"), model.predict(pairs, activation_fn=_identity()), atol=2e-5
    )
    assert all("text" not in r for r in raw)


def test_rerank_in_the_documents_shape_answers_as_vllm_and_infinity_clients_read_it(reranker, dirs):
    """/rerank given ``documents`` (vLLM's and Infinity's /rerank: Jina's and Cohere's body) answers that API's
    ``results``, as /v2/rerank does, its scores sentence-transformers' CrossEncoder's; given ``texts``, TEI's."""
    want = _cross_encoder(dirs["ce"]).predict([(QUERY, d) for d in DOCUMENTS])
    body = {"model": "ce", "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": True}
    answer = httpx.post(f"{reranker}/rerank", json=body).json()
    best = np.argsort(-want, kind="stable")[:2]
    assert [r["index"] for r in answer["results"]] == list(best)
    np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]], want[best], atol=1e-6)
    assert [r["document"]["text"] for r in answer["results"]] == [DOCUMENTS[i] for i in best]
    v2 = httpx.post(f"{reranker}/v2/rerank", json=body).json()
    assert answer["results"] == v2["results"] and answer["usage"] == v2["usage"]
    raw = httpx.post(f"{reranker}/rerank", json={**body, "raw_scores": True}).json()["results"]  # Infinity's
    logits = _cross_encoder(dirs["ce"]).predict([(QUERY, d) for d in DOCUMENTS], activation_fn=_identity())
    np.testing.assert_allclose([r["relevance_score"] for r in raw], logits[best], atol=2e-5)
    r = httpx.post(f"{reranker}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "texts": DOCUMENTS})
    assert r.status_code == 400 and "unknown field(s) ['documents']" in error_message(
        r
    )  # one shape at a time


def test_vllm_score_equals_sentence_transformers_cross_encoder_in_each_pairing(reranker, dirs):
    """vLLM's /score: one text with many (1:N) and as many of each (N:N), in every spelling of the two sides, the
    CrossEncoder's sigmoid, or its logit with use_activation false; the answer in vLLM's shape."""
    model = _cross_encoder(dirs["ce"])
    want = model.predict([(QUERY, d) for d in DOCUMENTS])
    answer = httpx.post(f"{reranker}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert (answer["object"], answer["model"], answer["id"][:6]) == ("list", "ce", "score-")
    assert [(d["index"], d["object"]) for d in answer["data"]] == [
        (i, "score") for i in range(len(DOCUMENTS))
    ]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > len(DOCUMENTS)
    np.testing.assert_allclose([d["score"] for d in answer["data"]], want, atol=1e-6)
    firsts = list(reversed(DOCUMENTS[:3]))
    for path, body in (
        ("/v1/score", {"text_1": [QUERY], "text_2": DOCUMENTS}),
        ("/score", {"data_1": QUERY, "data_2": DOCUMENTS}),
        ("/score", {"queries": QUERY, "documents": DOCUMENTS}),
        ("/score", {"queries": QUERY, "items": DOCUMENTS}),
    ):
        got = httpx.post(f"{reranker}{path}", json=body).json()["data"]
        np.testing.assert_allclose([d["score"] for d in got], want, atol=1e-6, err_msg=path)
    pairwise = httpx.post(f"{reranker}/score", json={"text_1": firsts, "text_2": DOCUMENTS[:3]}).json()[
        "data"
    ]
    np.testing.assert_allclose(
        [d["score"] for d in pairwise],
        model.predict(list(zip(firsts, DOCUMENTS[:3], strict=True))),
        atol=1e-6,
    )
    raw = httpx.post(
        f"{reranker}/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False}
    )
    logits = model.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=_identity())
    np.testing.assert_allclose([d["score"] for d in raw.json()["data"]], logits, atol=2e-5)


def test_vllm_classify_equals_transformers_text_classification_pipeline(classifier, dirs):
    """vLLM's /classify: each input's probabilities in the labels' order (the pipeline's softmax), its top label by
    name, the label count."""
    from transformers import pipeline

    reference = pipeline("text-classification", model=str(dirs["clf"]), top_k=None)
    for path in ("/classify", "/v1/classify"):
        answer = httpx.post(f"{classifier}{path}", json={"input": TEXTS}).json()
        assert (answer["object"], answer["model"], answer["id"][:9]) == ("list", "clf", "classify-")
        for i, (got, want) in enumerate(zip(answer["data"], reference(TEXTS), strict=True)):
            probs = [next(p["score"] for p in want if p["label"] == f"label_{k}") for k in range(3)]
            assert (got["index"], got["num_classes"], got["label"]) == (i, 3, want[0]["label"])
            np.testing.assert_allclose(got["probs"], probs, atol=1e-6)
    # truncate_prompt_tokens k: a text's last k tokens, as /v1/embeddings keeps them
    long = TEXTS[2]
    kept = httpx.post(f"{classifier}/classify", json={"input": long, "truncate_prompt_tokens": 6}).json()
    tokens = httpx.post(f"{classifier}/tokenize", json={"inputs": long}).json()[0]
    assert kept["usage"]["prompt_tokens"] == 6 < len(tokens)
    last = [
        t["text"] for t in tokens[-5:-1]
    ]  # its last 4 words, then [SEP]: what 6 tokens keep besides [CLS]
    tail = httpx.post(f"{classifier}/classify", json={"input": " ".join(last)}).json()["data"][0]["probs"]
    np.testing.assert_allclose(kept["data"][0]["probs"], tail, atol=1e-6)
    one = httpx.post(f"{classifier}/classify", json={"input": TEXTS[0], "use_activation": False}).json()[
        "data"
    ]
    logits = reference(TEXTS[0], function_to_apply="none")[0]
    want = [next(p["score"] for p in logits if p["label"] == f"label_{k}") for k in range(3)]
    np.testing.assert_allclose(one[0]["probs"], want, atol=2e-5)
    # vLLM's /pooling on a classifier: its task there (the default) is classify, the same probabilities
    pooled = httpx.post(f"{classifier}/pooling", json={"input": TEXTS}).json()
    assert pooled["id"].startswith("pool-") and [d["object"] for d in pooled["data"]] == ["pooling"] * len(
        TEXTS
    )
    for got, want in zip(pooled["data"], reference(TEXTS), strict=True):
        probs = [next(p["score"] for p in want if p["label"] == f"label_{k}") for k in range(3)]
        np.testing.assert_allclose(got["data"], probs, atol=1e-6)
    raw = httpx.post(
        f"{classifier}/pooling", json={"input": TEXTS[0], "task": "classify", "use_activation": False}
    )
    np.testing.assert_allclose(raw.json()["data"][0]["data"], one[0]["probs"], atol=1e-6)
    packed = httpx.post(f"{classifier}/pooling", json={"input": TEXTS, "encoding_format": "base64"}).json()
    for got, want in zip(packed["data"], pooled["data"], strict=True):
        np.testing.assert_allclose(
            np.frombuffer(base64.b64decode(got["data"]), "<f4"), want["data"], rtol=1e-6
        )
    r = httpx.post(f"{classifier}/pooling", json={"input": TEXTS[0], "task": "token_embed"})
    assert r.status_code == 400 and "'clf' is a classify model; /pooling needs embed" in error_message(r), (
        r.text
    )


def _transformers_pairs(directory: Path, max_length: int, docs: list[str]) -> np.ndarray:
    """transformers' *ForSequenceClassification on each (QUERY, doc) as the directory's tokenizer.json pairs and
    cuts them (in the document), through the sigmoid CrossEncoder applies: the reference where transformers' own
    tokenizer class would read these tiny WordPiece tokenizer.json files as something else (RoBERTa's BPE)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="only_second")
    model = AutoModelForSequenceClassification.from_pretrained(
        str(directory), attn_implementation="eager"
    ).eval()
    typed = (
        "token_type_ids" in inspect.signature(model.forward).parameters
    )  # BERT's; not DistilBERT's, MPNet's
    out = []
    for encoding in tok.encode_batch([(QUERY, d) for d in docs]):
        types = {"token_type_ids": torch.tensor([encoding.type_ids])} if typed else {}
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([encoding.ids]), **types).logits[0, 0].item())
    return 1 / (1 + np.exp(-np.array(out)))


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_every_familys_cross_encoder_reranks_as_transformers(reranker, dirs, artifacts, family):
    """RoBERTa's pairs (</s></s> between, no token types; XLM-RoBERTa's are the same), DistilBERT's and MPNet's;
    ELECTRA's head (GELU between its two products, where BERT's pooler has tanh)."""
    length = Manifest.load(artifacts[family]).text.max_length  # positions after the padding index: 62 of 64
    want = _transformers_pairs(dirs[family], length, DOCUMENTS)
    body = {"model": family, "query": QUERY, "documents": DOCUMENTS}
    results = httpx.post(f"{reranker}/v2/rerank", json=body).json()["results"]
    np.testing.assert_allclose(_by_index(results, "relevance_score"), want, atol=1e-6)


def test_the_official_cohere_clients_rerank_unmodified(reranker, dirs):
    import cohere

    want = _cross_encoder(dirs["ce"]).predict([(QUERY, d) for d in DOCUMENTS])
    v2 = cohere.ClientV2(api_key="unused", base_url=reranker)
    answer = v2.rerank(model="ce", query=QUERY, documents=DOCUMENTS, top_n=3)
    best = np.argsort(-want, kind="stable")[:3]
    assert [r.index for r in answer.results] == list(best)
    np.testing.assert_allclose([r.relevance_score for r in answer.results], want[best], atol=1e-6)
    # top_n past the documents: all of them, as Cohere does
    assert len(v2.rerank(model="ce", query=QUERY, documents=DOCUMENTS[:2], top_n=10).results) == 2
    v1 = cohere.Client(api_key="unused", base_url=reranker)
    docs = [DOCUMENTS[0], {"text": DOCUMENTS[1]}]  # v1's documents: strings or {"text"}
    old = v1.rerank(model="ce", query=QUERY, documents=docs, return_documents=True)
    assert {r.index: r.document.text for r in old.results} == {0: DOCUMENTS[0], 1: DOCUMENTS[1]}
    with pytest.raises(cohere.BadRequestError) as caught:
        v2.rerank(model="ce", query="", documents=DOCUMENTS)
    assert (
        caught.value.status_code == 400 and "query must be a non-empty string" in caught.value.body["message"]
    )


@pytest.mark.parametrize("model", ["ce", "roberta"])
def test_cohere_max_tokens_per_doc_cuts_each_document_to_that_many_of_its_tokens(
    reranker, dirs, artifacts, model
):
    """ClientV2.rerank's max_tokens_per_doc: each document cut to that many of its own tokens (the query whole), as
    transformers scores the pair tokenizers cut in its second text to the query's tokens, the pair's special
    tokens and that many (BERT's [CLS] q [SEP] d [SEP] and RoBERTa's <s> q </s></s> d </s>)."""
    import cohere
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(dirs[model] / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    query = len(tok.encode(QUERY, add_special_tokens=False).ids)
    specials = (
        len(tok.encode(QUERY, "x").ids) - query - 1
    )  # the pair's, beside the query's tokens and x's one
    v2 = cohere.ClientV2(api_key="unused", base_url=reranker)
    for per_doc in (3, 9):
        want = _transformers_pairs(dirs[model], query + specials + per_doc, DOCUMENTS)
        answer = v2.rerank(model=model, query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=per_doc)
        got = np.full(len(DOCUMENTS), np.nan)
        for r in answer.results:
            got[r.index] = r.relevance_score
        np.testing.assert_allclose(got, want, atol=1e-6)
        length = Manifest.load(artifacts[model]).text.max_length
        assert not np.allclose(want, _transformers_pairs(dirs[model], length, DOCUMENTS), atol=1e-6)


def _close(got: list[dict], want: list[dict]) -> None:
    """Two answers of labels by score, best first: the same labels in the same order, scores within float32's."""
    assert [p["label"] for p in got] == [p["label"] for p in want]
    np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in want], atol=2e-5)


def test_tei_predict_equals_transformers_text_classification_pipeline(classifier, dirs):
    """TEI's answer is the pipeline's own shape: every label by score, best first, the manifest's label names."""
    from transformers import pipeline

    reference = pipeline("text-classification", model=str(dirs["clf"]), top_k=None)
    batch = httpx.post(f"{classifier}/predict", json={"inputs": [[t] for t in TEXTS]}).json()
    assert len(batch) == len(TEXTS)
    for got, want in zip(batch, reference(TEXTS), strict=True):
        _close(got, want)
    _close(
        httpx.post(f"{classifier}/predict", json={"inputs": TEXTS[0]}).json(), batch[0]
    )  # one: not in a list
    pair = httpx.post(f"{classifier}/predict", json={"inputs": [QUERY, TEXTS[1]]}).json()
    _close(pair, reference({"text": QUERY, "text_pair": TEXTS[1]}))
    raw = httpx.post(f"{classifier}/predict", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    _close(raw, reference(TEXTS[0], function_to_apply="none")[0])


def test_v2_answers_a_heads_scores_for_text(classifier, dirs):
    body = {
        "inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": TEXTS[:2]}],
        "outputs": [{"name": "scores"}],
    }
    answer = httpx.post(f"{classifier}/v2/models/clf/infer", json=body).json()
    (out,) = answer["outputs"]
    assert out["name"] == "scores" and out["shape"] == [2, 3]
    from transformers import pipeline

    reference = pipeline("text-classification", model=str(dirs["clf"]), top_k=None, function_to_apply="none")
    logits = [
        [next(p["score"] for p in row if p["label"] == f"label_{i}") for i in range(3)]
        for row in reference(TEXTS[:2])
    ]
    np.testing.assert_allclose(np.reshape(out["data"], (2, 3)), logits, atol=2e-5)
    meta = httpx.get(f"{classifier}/v2/models/clf").json()
    assert {"name": "scores", "datatype": "FP32", "shape": [-1, 3]} in meta["outputs"]


def test_v2_scores_pairs_of_query_and_text_over_http_and_grpc_with_tritonclient(reranker, dirs):
    """V2's ``query`` input beside ``text`` (one query for every text, or one a text): each text scored with its
    query, the logits of the pair; tritonclient over HTTP and gRPC, unmodified."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    docs = DOCUMENTS[:4]
    want = _cross_encoder(dirs["ce"]).predict([(QUERY, d) for d in docs], activation_fn=_identity())
    for module, url in (
        (httpclient, reranker.removeprefix("http://")),
        (grpcclient, f"127.0.0.1:{GRPC_PORT}"),
    ):
        client = module.InferenceServerClient(url)
        text, query = module.InferInput("text", [4, 1], "BYTES"), module.InferInput("query", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[d.encode()] for d in docs], dtype=object))
        query.set_data_from_numpy(np.array([[QUERY.encode()]], dtype=object))
        answer = client.infer("ce", [text, query], outputs=[module.InferRequestedOutput("scores")])
        np.testing.assert_allclose(answer.as_numpy("scores")[:, 0], want, atol=2e-5)
    meta = httpx.get(f"{reranker}/v2/models/ce").json()
    assert {"name": "query", "datatype": "BYTES", "shape": [-1, 1]} in meta["inputs"]
    bytes_input = {"shape": [2, 1], "datatype": "BYTES", "data": ["a", "b"]}
    for inputs, words in (
        ([{"name": "query", **bytes_input}], "input 'query' comes with input 'text'"),
        (
            [
                {"name": "text", **bytes_input},
                {"name": "query", **bytes_input, "shape": [3, 1], "data": ["q"] * 3},
            ],
            "holds 3 queries for 2 texts",
        ),
    ):
        r = httpx.post(f"{reranker}/v2/models/ce/infer", json={"inputs": inputs})
        assert r.status_code == 400 and words in error_message(r), r.text
    r = httpx.post(
        f"{reranker}/v2/models/emb/infer",
        json={"inputs": [{"name": "text", **bytes_input}, {"name": "query", **bytes_input}]},
    )
    assert r.status_code == 400, r.text  # an embedder takes no query


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/rerank", {"texts": ["a"]}, 400, "missing field 'query'"),
        ("/rerank", {"query": "q"}, 400, "missing field 'texts'"),
        ("/rerank", {"query": "q", "texts": []}, 400, "texts must be a non-empty list"),
        ("/rerank", {"query": "q", "texts": ["a", ""]}, 400, "texts[1] must be a non-empty string"),
        ("/rerank", {"query": "q", "texts": ["a"] * 41}, 413, "41 texts, more than this server's 40"),
        ("/rerank", {"query": "q", "documents": []}, 400, "documents must be a non-empty list"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n must be a positive integer"),
        ("/rerank", {"query": "q", "documents": ["a"], "model": "nope"}, 404, "unknown model 'nope'"),
        ("/rerank", {"query": "q", "texts": ["word " * 80], "truncate": False}, 413, "texts[0] has"),
        ("/rerank", {"query": "word " * 80, "texts": ["a"], "truncate": True}, 413, "query alone takes more"),
        ("/rerank", {"query": "w" * 70_000, "texts": ["a"]}, 413, "query alone takes more"),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "raw_scores": "yes"},
            400,
            "raw_scores must be true or false",
        ),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "truncation_direction": "Middle"},
            400,
            "truncation_direction",
        ),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["a"], "top_n": 0},
            400,
            "top_n must be a positive integer",
        ),
        ("/v2/rerank", {"query": "q", "documents": ["a"] * 100_000}, 413, "100000 texts"),
        (
            "/v2/rerank",
            {"query": "q", "documents": [{"txt": "a"}]},
            400,
            "documents[0] must be a non-empty string",
        ),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "max_chunks_per_doc": 10}, 400, "not supported"),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["a"], "max_tokens_per_doc": 0},
            400,
            "max_tokens_per_doc must be a positive integer",
        ),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["a"], "max_tokens_per_doc": "8"},
            400,
            "max_tokens_per_doc must be a positive integer",
        ),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "model": "nope"}, 404, "unknown model 'nope'"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "model": "emb"}, 400, "'emb' is an embed model"),
        ("/predict", {"inputs": ["a", "b", "c"]}, 400, "a batch of texts is [[text], [text], ...]"),
        ("/predict", {"inputs": [["a"], ["b", "c"]]}, 400, "mixes single texts and pairs"),
        ("/predict", {"inputs": [["a", "b", "c"]]}, 400, "inputs[0] must be [text] or [text, text]"),
        ("/embed", {"inputs": "a"}, 400, "is a rerank model; /embed needs embed: ask it on /rerank"),
        (
            "/score",
            {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
            400,
            "text_1 holds 2 texts and text_2 3",
        ),
        ("/score", {"text_1": "a"}, 400, "a score needs its two sides once"),
        (
            "/score",
            {"text_1": "a", "text_2": ["b"], "queries": "c", "documents": ["d"]},
            400,
            "its two sides once",
        ),
        ("/score", {"text_1": "", "text_2": ["b"]}, 400, "text_1 must be a non-empty string"),
        ("/v1/score", {"text_1": "a", "text_2": [], "model": "ce"}, 400, "text_2 must be a non-empty list"),
        (
            "/score",
            {"text_1": "a", "text_2": ["b"], "model": "emb"},
            400,
            "'emb' is an embed model; /score needs",
        ),
        (
            "/score",
            {"text_1": "a", "text_2": ["b"], "use_activation": "no"},
            400,
            "use_activation must be true",
        ),
        ("/score", {"text_1": "a", "text_2": ["b"] * 100_000}, 413, "100000 texts"),
        (
            "/score",
            {"text_1": "a", "text_2": ["b"], "truncate_prompt_tokens": 5},
            400,
            "not supported for pairs",
        ),
        ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens must be -1"),
        ("/classify", {"inputs": "a"}, 400, "unknown field(s) ['inputs']"),
        ("/v1/classify", {"input": "a", "model": "nope"}, 404, "unknown model 'nope'"),
    ],
)
def test_every_bad_rerank_or_predict_is_a_4xx_naming_it(reranker, path, body, status, words):
    r = httpx.post(f"{reranker}{path}", json=body)
    assert r.status_code == status, r.text
    assert words in error_message(r), error_message(r)
    assert httpx.get(f"{reranker}/health/ready").status_code == 200


def test_a_classifier_refuses_rerank_and_names_predict(classifier):
    r = httpx.post(f"{classifier}/rerank", json={"query": "q", "texts": ["a"]})
    assert r.status_code == 400
    assert (
        "'clf' is a classify model; /rerank needs rerank: ask it on /predict, /classify or /pooling"
        in error_message(r)
    )


def test_schemathesis_finds_every_answer_of_a_cross_encoder_and_an_embedder_documented(reranker, tmp_path):
    """The OpenAPI document against a server of text models (tests/test_schemathesis.py's run is on a model of
    embeddings, where every text route answers 400): no answer of the text routes, TEI's, OpenAI's, Cohere's and vLLM's, is
    a 5xx or undocumented. (Longer runs of this against head models found /v1/encode?output=scores answering no
    ``encoded``, against the document: test_schemas.py holds every answer form to it.)"""
    # the text routes' tags, and /v1/encode's (the other operations: tests/test_schemathesis.py's run)
    text = "^(tei|openai|cohere|rerank|vllm|v1)$"
    report = run_schemathesis(reranker, "ce", tmp_path, options=("--include-tag-regex", text))
    selected, total = map(int, re.search(r"Selected: (\d+)/(\d+)", report).groups())
    assert 12 <= selected < total, report[-2000:]  # 15 of 35 on 2026-12-06


def test_tei_info_says_a_heads_kind_and_labels(reranker, classifier):
    ranker = httpx.get(f"{reranker}/info").json()
    assert ranker["model_id"] == "ce" and ranker["model_type"] == {
        "reranker": {"id2label": {"0": "label_0"}, "label2id": {"label_0": 0}}
    }
    labels = httpx.get(f"{classifier}/info").json()["model_type"]["classifier"]["id2label"]
    assert labels == {"0": "label_0", "1": "label_1", "2": "label_2"}
