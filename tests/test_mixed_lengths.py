"""Requests of different lengths from different clients, over every way in (/v1 JSON, V2 binary over HTTP with
tritonclient, gRPC with tritonclient, masks included), queued together on a real server: each answer equals the
request run alone in-process, and merging by cost computes a fraction of the padding that merging in order does
(read from the server's own addnorm_batch_positions counter). bench/mixed.py measures the speed."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th

from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
from addnorm.model.packing import answered, real_lengths
from addnorm.service.backend.engine import Engine
from bench.mixed import padding_counts
from tests.conftest import start_server

# two clusters of lengths, as short queries and passages are; one request per transport and length
LENGTHS = (3, 5, 4, 6, 60, 64, 62, 58)
ATOL, RTOL = 1e-5, 1e-4


def _requests():
    rng = np.random.default_rng(37)
    out = []
    for i, n in enumerate(LENGTHS):
        x = rng.standard_normal((1 + i % 2, n, 32)).astype(np.float32)
        mask = None
        if i in (2, 6):  # padding of its own: it stays the request's, merged or not
            mask = np.zeros(x.shape[:2], bool)
            mask[-1, n // 2 :] = True
        out.append((x, mask))
    return out


def _v1(base: str, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    body = {EMBEDDINGS: x.tolist(), **({MASK: mask.tolist()} if mask is not None else {})}
    r = httpx.post(f"{base}/v1/encode", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json()[ENCODED], np.float32)


def _v2(module, client, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    inputs = [module.InferInput(EMBEDDINGS, list(x.shape), "FP32")]
    if module is th:
        inputs[0].set_data_from_numpy(x, binary_data=True)
    else:
        inputs[0].set_data_from_numpy(x)
    if mask is not None:
        inputs.append(module.InferInput(MASK, list(mask.shape), "BOOL"))
        inputs[-1].set_data_from_numpy(mask)
    return client.infer("encoder", inputs).as_numpy(ENCODED)


def _serve_together(tiny_artifact, merge: str) -> tuple[list[np.ndarray], dict[str, float]]:
    """Every request of _requests() over each transport at once (a 1 s queue delay gathers them into the
    queue together), on a server merging by ``merge``; the answers in order, and the positions it computed."""
    reqs = _requests()
    with start_server(
        tiny_artifact, "--merge-lengths", merge, "--max-queue-delay-ms", "1000", grpc=True
    ) as srv:
        http = th.InferenceServerClient(
            srv.base.removeprefix("http://"), concurrency=len(reqs), network_timeout=60.0
        )
        grpc = tg.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        calls = [lambda x=x, m=m: _v1(srv.base, x, m) for x, m in reqs]
        calls += [lambda x=x, m=m: _v2(th, http, x, m) for x, m in reqs]
        calls += [lambda x=x, m=m: _v2(tg, grpc, x, m) for x, m in reqs]
        with ThreadPoolExecutor(len(calls)) as pool:
            answers = list(pool.map(lambda call: call(), calls))
        requested, padding = padding_counts(srv.port)
        http.close()
        grpc.close()
    return answers, {"requested": requested, "padding": padding}


@pytest.mark.parametrize("merge", ["cost", "pad"])
def test_every_transport_answers_mixed_lengths_as_alone(tiny_artifact, merge):
    engine = Engine(tiny_artifact, "cpu", intra_op_threads=1)
    answers, positions = _serve_together(tiny_artifact, merge)
    # a row's trailing padding is not computed: it answers zeros and counts as no position
    want = [answered(engine.run(x, m)[ENCODED], m) for x, m in _requests()] * 3
    for got, expected in zip(answers, want, strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=RTOL)
    own = [x.shape[0] * x.shape[1] if m is None else int(real_lengths(m).sum()) for x, m in _requests()]
    assert positions["requested"] == 3 * sum(own)


def test_merging_by_cost_computes_a_fraction_of_the_padding(tiny_artifact):
    _, by_cost = _serve_together(tiny_artifact, "cost")
    _, in_order = _serve_together(tiny_artifact, "pad")
    assert by_cost["requested"] == in_order["requested"]
    # in order, the short requests are padded to ~60 positions whenever they share a run with a long one
    assert in_order["padding"] > 0.5 * in_order["requested"], in_order
    assert by_cost["padding"] < 0.25 * in_order["padding"], (by_cost, in_order)
