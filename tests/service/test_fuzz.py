"""Hostile input, generated: the codecs raise only ServiceError (a 4xx), and the live server never answers 5xx."""

import json
import random

import httpx
import numpy as np
import pytest

from addnorm.model.artifact import Manifest
from addnorm.service.errors import ServiceError, http_status
from addnorm.service.protocols.v1 import codec as codec_v1
from addnorm.service.protocols.v2 import codec as codec_v2

CASES = 1500


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.uniform(-1e40, 1e40)
    if kind == 1:
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(["", "a", "1.0", "NaN", "embeddings"])
    if kind == 4:
        return rng.random()
    if kind == 5:
        return {}
    n = rng.randrange(0, 5)
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(n)]
    if kind == 7:  # a plausible tensor, sometimes slightly wrong
        shape = [rng.randrange(0, 3) for _ in range(rng.randrange(1, 4))] + [rng.choice([32, 31, 0])]
        return np.zeros(shape).tolist()
    return {
        rng.choice(
            [
                "embeddings",
                "mask",
                "inputs",
                "outputs",
                "name",
                "shape",
                "datatype",
                "data",
                "id",
                "parameters",
                "binary_data_size",
                "x",
            ]
        ): random_value(rng, depth + 1)
        for _ in range(n)
    }


def v2_doc(rng: random.Random) -> dict:
    spec = {
        "name": rng.choice(["embeddings", "mask", "x"]),
        "shape": random_value(rng, 3),
        "datatype": rng.choice(["FP32", "FP16", "BOOL", "INT8", 5]),
        rng.choice(["data", "parameters"]): random_value(rng, 2),
    }
    if rng.random() < 0.5:
        spec["shape"] = [rng.randrange(0, 3), rng.randrange(0, 3), rng.choice([32, 3, 2**62])]
        spec["data"] = np.zeros(rng.randrange(0, 200)).tolist()
    doc = {"inputs": [spec] * rng.randrange(0, 3)}
    if rng.random() < 0.3:
        doc["outputs"] = random_value(rng, 2)
    if rng.random() < 0.3:
        doc["parameters"] = random_value(rng, 3)
    return doc


@pytest.fixture(scope="module")
def manifest(tiny_artifact):
    return Manifest.load(tiny_artifact)


def test_v1_codec_only_raises_api_errors():
    rng = random.Random(0)
    for _ in range(CASES):
        body = json.dumps(random_value(rng)).encode()
        try:
            req = codec_v1.decode("application/json", body, None, 32, 10_000)
        except ServiceError as exc:
            assert 400 <= http_status(exc) < 500 and exc.message
        else:
            assert req.embeddings.ndim == 3 and req.embeddings.shape[-1] == 32


def test_v2_codec_only_raises_api_errors(manifest):
    rng = random.Random(1)
    for _ in range(CASES):
        body = json.dumps(v2_doc(rng)).encode()
        binary = bytes(rng.randrange(0, 64)) if rng.random() < 0.3 else b""
        header = str(len(body)) if binary else None
        try:
            req = codec_v2.decode_infer(body + binary, header, manifest, 10_000)
        except ServiceError as exc:
            assert 400 <= http_status(exc) < 500 and exc.message
        else:
            assert req.embeddings.dtype == np.float32 and req.embeddings.shape[-1] == 32


def test_live_server_never_answers_5xx(server):
    rng = random.Random(2)
    with httpx.Client(base_url=server, timeout=30) as c:
        for i in range(300):
            if i % 3 == 0:
                url, body = "/v2/models/encoder/infer", json.dumps(v2_doc(rng)).encode()
            else:
                url, body = "/v1/encode", json.dumps(random_value(rng)).encode()
            if i % 7 == 0:
                body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # binary garbage
            headers = {
                "content-type": rng.choice(
                    ["application/json", "application/octet-stream", "application/x-npy", "text/plain", ""]
                )
            }
            if i % 5 == 0:
                headers["x-shape"] = rng.choice(["1,2,32", "a", "-1", "1,1,1,1,32"])
            if i % 11 == 0:
                headers["inference-header-content-length"] = str(rng.randrange(-5, 300))
            r = c.post(url, content=body, headers=headers)
            assert r.status_code < 500, (url, body[:200], headers, r.text)
            if r.status_code >= 400:
                assert set(r.json()) == {"error"}
        assert c.get("/health/ready").status_code == 200
