"""The request core (service/core/inference.py): one deadline rule and one cancellation for every transport."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from addnorm.service import create_app
from addnorm.service.core import inference
from addnorm.service.protocols.v2 import grpc_server
from addnorm.service.protocols.v2 import inference_pb2 as pb
from addnorm.service.settings import Settings
from bench.server import free_port
from tests.helpers import wait_until, wait_until_ready

E = 32  # tiny_artifact's d_model


def test_the_deadline_is_the_soonest_of_the_client_the_protocol_and_the_server():
    known = SimpleNamespace(settings=SimpleNamespace(request_timeout_s=30.0))
    req = SimpleNamespace(timeout_s=None)
    assert inference.deadline(known, inference.Call("v1"), req) == 30.0
    assert inference.deadline(known, inference.Call("v2"), SimpleNamespace(timeout_s=2.5)) == 2.5
    assert (
        inference.deadline(known, inference.Call("grpc", deadline_s=0.7), SimpleNamespace(timeout_s=2.5))
        == 0.7
    )
    assert inference.deadline(known, inference.Call("grpc", deadline_s=90.0), req) == 30.0  # never longer


@pytest.fixture
def blocked_app(tiny_artifact):
    """The app with gRPC on, and its model's runs held at a gate; yields (model, gRPC target, shapes run, gate,
    HTTP client)."""
    port = free_port()
    app = create_app(Settings(artifact=tiny_artifact, grpc_port=port, max_batch_size=1))
    with TestClient(app) as client:
        wait_until_ready(client)
        model = app.state.addnorm.known.models.default
        run, gate, shapes = model.engine.run, threading.Event(), []

        def held(x, mask=None, light=False):
            shapes.append(x.shape)
            gate.wait(10)
            return run(x, mask, light=light)

        model.engine.run = held
        try:
            yield model, f"127.0.0.1:{port}", shapes, gate, client
        finally:
            gate.set()
            model.engine.run = run


def _infer_request(seq: int) -> pb.ModelInferRequest:
    x = np.zeros((1, seq, E), np.float32)
    tensor = pb.ModelInferRequest.InferInputTensor(name="embeddings", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name="encoder", inputs=[tensor], raw_input_contents=[x.tobytes()])


def _model_infer(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        f"/{grpc_server.SERVICE}/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def _first_call_running(
    channel: grpc.Channel, shapes: list
) -> tuple[grpc.UnaryUnaryMultiCallable, grpc.Future]:
    """A ModelInfer callable, and a first call whose run is held at the gate (the next one queues behind it)."""
    infer = _model_infer(channel)
    running = infer.future(_infer_request(2), timeout=30)
    wait_until(lambda: (1, 2, E) in shapes, 10, "the first call running")
    return infer, running


def test_a_grpc_call_its_client_cancels_drops_its_queued_work(blocked_app):
    model, target, shapes, gate, _ = blocked_app
    with grpc.insecure_channel(target) as channel:
        infer, running = _first_call_running(channel, shapes)
        queued = infer.future(_infer_request(7), timeout=30)
        wait_until(lambda: model.batcher.depth == 1, 10, "the second call queued")
        queued.cancel()
        # out of the queue while the first run still holds the model (its gate waits 10 s), not when it ends
        wait_until(lambda: model.batcher.depth == 0, 5, "the cancelled call leaving the queue")
        gate.set()
        assert running.result().model_name == "encoder"
    assert (1, 7, E) not in shapes


def test_a_grpc_deadline_drops_queued_work_too(blocked_app):
    model, target, shapes, gate, _ = blocked_app
    with grpc.insecure_channel(target) as channel:
        infer, running = _first_call_running(channel, shapes)
        with pytest.raises(grpc.RpcError) as info:
            infer(_infer_request(9), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the server learns of the deadline on its own clock, shortly after the client gives up (later on a
        # busy machine): the queued call leaves the queue while the running one still holds the model
        wait_until(lambda: model.batcher.depth == 0, 5, "the expired call leaving the queue")
        gate.set()
        running.result()
    assert (1, 9, E) not in shapes


def test_a_request_whose_own_timeout_passes_gets_408(blocked_app):
    """The client's shorter deadline is its choice: a 4xx that says so; the server's own limit passing stays a 504."""
    from addnorm.service.errors import ClientDeadline, TimedOut, grpc_code, http_status

    assert http_status(TimedOut("x")) == 504 and http_status(ClientDeadline("x")) == 408
    assert grpc_code(TimedOut("x")) == grpc_code(ClientDeadline("x")) == "DEADLINE_EXCEEDED"
    model, target, shapes, gate, client = blocked_app
    body = {
        "inputs": [{"name": "embeddings", "shape": [1, 3, E], "datatype": "FP32", "data": [0.1] * (3 * E)}],
        "parameters": {"timeout": 1000},  # 1 ms, in microseconds
    }
    with grpc.insecure_channel(target) as channel:
        _, running = _first_call_running(channel, shapes)
        r = client.post("/v2/models/encoder/infer", json=body)
        gate.set()
        running.result()
    assert r.status_code == 408 and "request's own deadline of 0.001 s" in r.json()["error"], r.text


def _hops(monkeypatch) -> list[str]:
    """The codec steps ``inference.offload`` sends to a worker thread, by function name, from now on."""
    hops, worker = [], inference.in_worker

    async def counted(fn, *args):
        hops.append(fn.__name__)
        return await worker(fn, *args)

    monkeypatch.setattr(inference, "in_worker", counted)
    return hops


def test_codec_steps_leave_the_event_loop_by_their_work_not_their_bytes(tiny_artifact, monkeypatch):
    """A raw tensor is 40-140x less work per byte than JSON text, and a thread hop costs 0.2-0.4 ms: a 3 MB binary
    body (decoded in ~0.3 ms) stays on the event loop, where every body over 256 KB left it before; JSON of more
    than OFFLOAD_BYTES still leaves it, both ways, over /v1 and V2 alike."""
    from addnorm.service.protocols.v1 import codec as v1
    from addnorm.service.protocols.v2 import codec as v2
    from addnorm.service.protocols.v2 import grpc_codec

    x = np.random.default_rng(0).standard_normal((8, 3072, E)).astype(np.float32)  # 3 MiB raw
    raw = x.tobytes()
    header = b'{"inputs": []}'
    assert (
        v2.InferCodec("m", str(len(header)), 10**9).decode_work(header + raw) == len(header) + len(raw) // 16
    )
    assert v2.InferCodec("m", None, 10**9).decode_work(raw) == len(raw)  # a JSON body: every byte is text
    for bad in ("x", "-5", "9" * 5000, str(len(raw) * 2)):  # refused by the decode itself, at once
        assert v2.InferCodec("m", bad, 10**9).decode_work(raw) == 0
    v1_codec = lambda content_type: v1.EncodeCodec(content_type, {}, None, v1.JSON, None, 10**9)  # noqa: E731
    assert v1_codec(v1.OCTET).decode_work(raw) == len(raw) // 16
    assert v1_codec("application/json; charset=utf-8").decode_work(raw) == len(raw)
    message = pb.ModelInferRequest(model_name="m", raw_input_contents=[raw])
    assert (
        grpc_codec.GrpcInferCodec("m", 10**9).decode_work(message) == message.ByteSize() - len(raw) * 15 // 16
    )
    assert (
        max(v2.InferCodec("m", "1", 10**9).decode_work(header + raw), len(raw) // 16)
        <= inference.OFFLOAD_BYTES
    )

    app = create_app(Settings(artifact=tiny_artifact))
    with TestClient(app) as client:
        wait_until_ready(client)
        hops = _hops(monkeypatch)
        spec = {"name": "embeddings", "shape": list(x.shape), "datatype": "FP32"}
        header = json.dumps(
            {
                "inputs": [{**spec, "parameters": {"binary_data_size": len(raw)}}],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
        r = client.post(
            "/v2/models/encoder/infer",
            content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        assert r.status_code == 200 and hops == [], (r.status_code, hops)
        small = x[:1]  # 384 KiB of float32, about 4 MB of JSON text each way
        r = client.post(
            "/v2/models/encoder/infer",
            json={"inputs": [{**spec, "shape": list(small.shape), "data": small.ravel().tolist()}]},
        )
        assert r.status_code == 200 and hops == ["decode", "encode"], (r.status_code, hops)
        hops.clear()
        r = client.post("/v1/encode", json={"embeddings": small[0].tolist()})
        assert r.status_code == 200 and hops == ["decode", "encode"], (r.status_code, hops)
        hops.clear()
        r = client.post(
            "/v1/encode",
            content=raw,
            headers={"content-type": v1.OCTET, "x-shape": "8,3072,32", "accept": v1.OCTET},
        )
        assert r.status_code == 200 and hops == [], (r.status_code, hops)
