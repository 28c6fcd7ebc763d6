"""End to end: PyTorch's own layer -> addnorm-export -> addnorm-serve (a real uvicorn process) -> HTTP."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.conftest import ROOT, start_server

E2E_ATOL = 1e-5


@pytest.fixture(scope="module")
def torch_layer_server(tmp_path_factory):
    """Weights saved from torch.nn.TransformerEncoderLayer, exported by the CLI, served by the CLI."""
    tmp = tmp_path_factory.mktemp("e2e")
    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(64, 4, 128, activation="gelu", batch_first=True).eval()
    save_file({k: v.contiguous() for k, v in layer.state_dict().items()}, str(tmp / "layer.safetensors"))
    cmd = [
        sys.executable,
        "-m",
        "addnorm.export",
        "--artifact",
        str(tmp / "art"),
        "--checkpoint",
        str(tmp / "layer.safetensors"),
        "--d-model",
        "64",
        "--nhead",
        "4",
        "--dim-feedforward",
        "128",
        "--activation",
        "gelu",
        "-q",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    with start_server(tmp / "art") as srv:
        yield layer, srv.base


def test_http_response_equals_pytorch_own_layer(torch_layer_server):
    layer, base = torch_layer_server
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 9, 64)).astype(np.float32)
    mask = np.zeros((3, 9), bool)
    mask[1, 6:] = True
    r = httpx.post(f"{base}/v1/encode", json={"embeddings": x.tolist(), "mask": mask.tolist()}, timeout=30)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["encoded"], dtype=np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(mask)).numpy()
    valid = ~mask  # PyTorch's fast path zeroes padded positions; compare the real tokens
    np.testing.assert_allclose(got[valid], want[valid], atol=E2E_ATOL, rtol=0)
    one = httpx.post(f"{base}/v1/encode", json={"embeddings": x[0].tolist()}, timeout=30).json()
    assert one["shape"] == [9, 64]
    np.testing.assert_allclose(one["encoded"], want[0], atol=E2E_ATOL, rtol=0)


def test_server_survives_bad_input_and_concurrency(server):
    bad = [
        b"{",
        b'{"embeddings": [[NaN]]}',
        b'{"embeddings": [["a"]]}',
        b"\x00" * 1000,
        b'{"embeddings": [[1]]}',
    ]
    with httpx.Client(base_url=server, timeout=30) as c:
        for body in bad:
            r = c.post("/v1/encode", content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500 and "error" in r.json()
        x = np.random.default_rng(1).standard_normal((2, 4, 32)).astype(np.float32).tolist()

        def call(_):
            return c.post("/v1/encode", json={"embeddings": x}).json()["encoded"]

        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(call, range(32)))
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], atol=E2E_ATOL, rtol=1e-4)
        assert c.get("/health/ready").status_code == 200


def test_server_refuses_to_start_on_a_tampered_artifact(tiny_artifact, tmp_path):
    for name in ("manifest.json", "model.onnx", "weights.safetensors"):
        (tmp_path / name).write_bytes((tiny_artifact / name).read_bytes())
    (tmp_path / "model.onnx").write_bytes((tmp_path / "model.onnx").read_bytes()[:-1] + b"\x01")
    r = subprocess.run(
        [sys.executable, "-m", "addnorm.service", "--artifact", str(tmp_path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "sha256" in r.stderr


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this machine has CUDA")
def test_server_refuses_cuda_where_there_is_none(tiny_artifact):
    r = subprocess.run(
        [sys.executable, "-m", "addnorm.service", "--artifact", str(tiny_artifact), "--providers", "cuda"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "CUDAExecutionProvider is not available" in r.stderr


def test_serve_help_lists_every_setting():
    out = subprocess.run(
        [sys.executable, "-m", "addnorm.service", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    for flag in ("--artifact", "--providers", "--max-batch-size", "--max-elements", "ADDNORM_PORT"):
        assert flag in out


def test_clients_that_hang_up_mid_request_do_not_hurt_the_server(server):
    import socket

    host, port = "127.0.0.1", int(server.rsplit(":", 1)[1])
    for body in (b'{"embeddings": [[', b"x" * 10):  # promised 100000 bytes, sent a few, hung up
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(
                b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n" + body
            )
    with socket.create_connection((host, port), timeout=5) as s:  # hang up while the answer is computed
        payload = b'{"embeddings": ' + str([[0.5] * 32] * 64).encode() + b"}"
        s.sendall(
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )
    with socket.create_connection((host, port), timeout=5) as s:  # not HTTP at all
        s.sendall(b"\x16\x03\x01 garbage that is not HTTP\r\n\r\n")
    r = httpx.post(f"{server}/v1/encode", json={"embeddings": [[0.1] * 32]}, timeout=30)
    assert r.status_code == 200 and httpx.get(f"{server}/health/ready").status_code == 200


def test_backpressure_and_timeouts_over_http(tiny_artifact):
    """A full queue answers 429 with Retry-After, a missed deadline of the client's own 408; never a 5xx, server
    stays up."""
    with start_server(tiny_artifact, "--max-queue-size", "1", "--max-batch-size", "1") as srv:
        base = srv.base
        # raw float32: decoded on the event loop (a JSON body this big is decoded in a worker, a few at a time:
        # cores.in_worker), so the 16 clients reach the queue at once
        x = np.zeros((8, 512, 32), np.float32).tobytes()
        binary = {"content-type": "application/octet-stream", "x-shape": "8,512,32"}
        with httpx.Client(base_url=base, timeout=60) as c:

            def call(_):
                return c.post("/v1/encode", content=x, headers=binary)

            with ThreadPoolExecutor(16) as pool:
                responses = list(pool.map(call, range(48)))
            statuses = {r.status_code for r in responses}
            assert statuses <= {200, 429}, statuses
            assert 200 in statuses and 429 in statuses, statuses  # the queue really filled up
            for r in responses:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1" and "capacity" in r.json()["error"]
            doc = {
                "inputs": [
                    {"name": "embeddings", "shape": [1, 1, 32], "datatype": "FP32", "data": [0.0] * 32}
                ],
                "parameters": {"timeout": 1},
            }  # one microsecond: always missed
            r = c.post("/v2/models/encoder/infer", json=doc)
            assert r.status_code == 408 and "not answered within" in r.json()["error"]
            assert c.get("/health/ready").status_code == 200
