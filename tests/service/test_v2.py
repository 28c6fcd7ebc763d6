"""Open Inference Protocol (V2): an unmodified tritonclient against a real server, plus the codec's errors."""

import asyncio
import gzip
import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from addnorm.model.artifact import Manifest
from addnorm.model.packing import answered
from addnorm.service.errors import ServiceError, http_status
from addnorm.service.protocols.v2 import codec as codec_v2

D = 32
MODEL = "encoder"


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(server.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def data(tiny_artifact):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    mask[1, 3:] = True
    sess = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    # the server answers zeros at a row's trailing padding, which it does not compute
    return x, mask, answered(sess.run(None, {"embeddings": x, "mask": mask})[0], mask)


def inputs(x, mask, binary):
    a = triton.InferInput("embeddings", list(x.shape), "FP32")
    a.set_data_from_numpy(x, binary_data=binary)
    b = triton.InferInput("mask", list(mask.shape), "BOOL")
    b.set_data_from_numpy(mask, binary_data=binary)
    return [a, b]


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1") and not client.is_model_ready("other")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata(MODEL)
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert meta["inputs"] == [
        {"name": "embeddings", "datatype": "FP32", "shape": [-1, -1, D]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
    ]
    assert meta["outputs"] == [{"name": "encoded", "datatype": "FP32", "shape": [-1, -1, D]}]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_infer_equals_onnxruntime_in_every_binary_json_combination(client, data, binary_in, binary_out):
    x, mask, want = data
    outputs = None if binary_out is None else [triton.InferRequestedOutput("encoded", binary_data=binary_out)]
    result = client.infer(MODEL, inputs(x, mask, binary_in), outputs=outputs, request_id="req-7")
    np.testing.assert_allclose(result.as_numpy("encoded"), want, atol=1e-6, rtol=0)
    assert result.get_response()["id"] == "req-7"
    assert result.get_response()["model_name"] == MODEL


def test_versioned_infer_gzip_and_timeout(client, data):
    x, mask, want = data
    r = client.infer(
        MODEL,
        inputs(x, mask, True),
        model_version="1",
        request_compression_algorithm="gzip",
        timeout=10_000_000,
    )
    np.testing.assert_allclose(r.as_numpy("encoded"), want, atol=1e-6, rtol=0)


def test_async_client(server, data):
    x, mask, want = data

    async def main():
        c = triton_aio.InferenceServerClient(server.removeprefix("http://"))
        try:
            assert await c.is_model_ready(MODEL)
            results = await asyncio.gather(*(c.infer(MODEL, inputs(x, mask, b)) for b in (True, False) * 4))
        finally:
            await c.close()
        return results

    for r in asyncio.run(main()):
        np.testing.assert_allclose(r.as_numpy("encoded"), want, atol=1e-6, rtol=0)


def test_errors_reach_the_client_with_the_server_message(client, data):
    x, mask, _ = data
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as info:
        client.infer("nope", inputs(x, mask, True))
    assert info.value.status() == "404"
    with pytest.raises(InferenceServerException, match="unknown version '3'") as info:
        client.get_model_metadata(MODEL, "3")
    assert info.value.status() == "404"
    bad = triton.InferInput("embeddings", [1, 2, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 2, 3), np.float32))
    with pytest.raises(InferenceServerException, match="d_model is 32") as info:
        client.infer(MODEL, [bad])
    assert info.value.status() == "400"
    wrong = triton.InferInput("mask", [2, 5], "BOOL")
    wrong.set_data_from_numpy(np.zeros((2, 5), bool))
    with pytest.raises(InferenceServerException, match="missing input 'embeddings'"):
        client.infer(MODEL, [wrong])


def test_raw_http_errors_are_json(server):
    url = f"{server}/v2/models/{MODEL}/infer"
    for body, headers, message in [
        (b"{", {}, "malformed JSON"),
        (b'{"inputs": []}', {}, "non-empty 'inputs'"),
        (
            b'{"inputs": [{"name": "embeddings", "shape": [1, 1, 32], "datatype": "FP32", "parameters": {"binary_data_size": 128}}]}',
            {},
            "runs past the end",
        ),
        (b"x" * 10, {"inference-header-content-length": "99"}, "does not fit"),
        (b"x" * 10, {"content-encoding": "br"}, "Content-Encoding"),
        (gzip.compress(b"{")[:5], {"content-encoding": "gzip"}, "gzip"),
    ]:
        r = httpx.post(url, content=body, headers=headers, timeout=10)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert message in r.json()["error"]


def _manifest(tiny_artifact):
    return Manifest.load(tiny_artifact)


def _request(inputs_, outputs=None, **extra):
    doc = {"inputs": inputs_, **extra}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


EMB = {"name": "embeddings", "shape": [1, 2, D], "datatype": "FP32", "data": [0.5] * (2 * D)}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_request([{**EMB, "data": [0.5] * 3}]), "needs 64"),
        (_request([{**EMB, "datatype": "INT8"}]), "not supported"),
        (_request([{**EMB, "shape": [1, -2, D]}]), "non-negative integers"),
        (_request([{**EMB, "data": ["a"] * (2 * D)}]), "only numbers"),
        (_request([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]), "unknown input 'x'"),
        (_request([EMB, EMB]), "given twice"),
        (
            _request([EMB, {"name": "mask", "shape": [1, 2], "datatype": "FP32", "data": [0, 1]}]),
            "must be BOOL",
        ),
        (
            _request([EMB, {"name": "mask", "shape": [1, 2], "datatype": "BOOL", "data": [1, 0]}]),
            "true/false",
        ),
        (
            _request([EMB, {"name": "mask", "shape": [1, 3], "datatype": "BOOL", "data": [True] * 3}]),
            "mask shape",
        ),
        (_request([{**EMB, "shape": [2, D], "data": [0.5] * (2 * D)}]), "rank|batch, seq"),
        (_request([{**EMB, "data": [1e39] * (2 * D)}]), "finite"),
        (_request([EMB], outputs=[{"name": "hidden"}]), "unknown output 'hidden'"),
        (_request([EMB], id=5), "'id' must be a string"),
        (_request([EMB], parameters={"timeout": -1}), "timeout"),
        (_request([{k: v for k, v in EMB.items() if k != "data"}]), "neither 'data'"),
    ],
)
def test_codec_rejects_bad_requests(tiny_artifact, doc, message):
    with pytest.raises(ServiceError, match=message) as info:
        codec_v2.decode_infer(doc, None, _manifest(tiny_artifact), 10_000)
    assert 400 <= http_status(info.value) < 500


def test_binary_inputs_are_zero_copy_views_and_extra_bytes_are_refused(tiny_artifact):
    x = np.arange(2 * D, dtype="<f4")
    header = _request(
        [
            {
                "name": "embeddings",
                "shape": [1, 2, D],
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ]
    )
    body = header + x.tobytes()
    req = codec_v2.decode_infer(body, str(len(header)), _manifest(tiny_artifact), 10_000)
    np.testing.assert_array_equal(req.embeddings.ravel(), x)
    assert not req.embeddings.flags.owndata  # a view on the request body
    with pytest.raises(ServiceError, match="no input claims"):
        codec_v2.decode_infer(body + b"\0\0\0\0", str(len(header)), _manifest(tiny_artifact), 10_000)


def test_response_encoding_binary_and_json(tiny_artifact):
    out = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    req = codec_v2.InferRequest("7", out, None, [codec_v2.RequestedOutput("encoded", True)])
    body, headers = codec_v2.encode_infer(req, MODEL, {"encoded": out})
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    assert head["id"] == "7" and head["outputs"][0]["parameters"]["binary_data_size"] == 24
    np.testing.assert_array_equal(np.frombuffer(body[n:], "<f4"), out.ravel())
    req.outputs = [codec_v2.RequestedOutput("encoded", False)]
    body, headers = codec_v2.encode_infer(req, MODEL, {"encoded": out})
    assert (
        json.loads(body)["outputs"][0]["data"] == list(range(6))
        and headers["Content-Type"] == "application/json"
    )


def test_tritonclient_passes_the_api_key_with_headers(tiny_artifact, data):
    from tests.conftest import start_server

    x, mask, want = data
    with start_server(tiny_artifact, "--api-key", "triton-key-1") as srv:
        c = triton.InferenceServerClient(srv.base.removeprefix("http://"))
        auth = {"Authorization": "Bearer triton-key-1"}
        result = c.infer(MODEL, inputs(x, mask, True), headers=auth)
        np.testing.assert_allclose(result.as_numpy("encoded"), want, atol=1e-6, rtol=0)
        with pytest.raises(InferenceServerException, match="API key") as info:
            c.infer(MODEL, inputs(x, mask, True))
        assert info.value.status() == "401"
        assert c.is_server_live() and c.is_server_ready()  # the health probes need no key
        c.close()
