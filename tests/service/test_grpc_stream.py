"""ModelStreamInfer: many requests on one gRPC call, with tritonclient's own stream APIs (sync and aio) and stub
against a real server, and the stream's limits (in flight, idle, cancel) on the handler itself."""

from __future__ import annotations

import asyncio
import queue
import urllib.request
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_grpc

from addnorm.service.errors import BadInput
from addnorm.service.protocols.v2 import grpc_stream
from addnorm.service.protocols.v2 import inference_pb2 as pb
from tests.service.test_grpc import AUTH, E, _input, reference


def _request(
    model: str, x: np.ndarray, rid: str, mask: np.ndarray | None = None
) -> triton_pb.ModelInferRequest:
    request = triton_pb.ModelInferRequest(model_name=model, id=rid)
    request.inputs.add(name="embeddings", datatype="FP32", shape=x.shape)
    request.raw_input_contents.append(x.tobytes())
    if mask is not None:
        request.inputs.add(name="mask", datatype="BOOL", shape=mask.shape)
        request.raw_input_contents.append(mask.tobytes())
    return request


def _encoded(response: triton_pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)


def test_a_stream_answers_every_request_by_its_id_and_a_refusal_does_not_end_it(
    repo_server, model_repository
):
    """tritonclient's stub: requests of different lengths, models and masks on one stream, a refused one among
    them; each answer equals in-process onnxruntime on its own graph, the refusal carries its request's id and
    says why, the requests after it are answered, and each request counts in the metrics."""
    rng = np.random.default_rng(3)
    sent, requests = {}, []
    for i, (model, folder, s) in enumerate(
        [("encoder", "a-fp32", 3), ("encoder-int8", "b-int8", 17), ("encoder", "a-fp32", 40)] * 3
    ):
        x = rng.standard_normal((2, s, E)).astype(np.float32)
        mask = np.zeros((2, s), bool)
        mask[1, s // 2 :] = True
        sent[f"r{i}"] = (folder, x, mask)
        requests.append(_request(model, x, f"r{i}", mask))
    requests.insert(4, _request("no-such-model", np.ones((1, 2, E), np.float32), "gone"))
    requests.insert(6, triton_pb.ModelInferRequest(model_name="encoder", id="empty"))
    with grpc.insecure_channel(f"127.0.0.1:{repo_server.grpc_port}") as channel:
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        responses = list(stub.ModelStreamInfer(iter(requests), metadata=tuple(AUTH.items()), timeout=60))
    by_id = {r.infer_response.id: r for r in responses}
    assert len(responses) == len(requests) == len(by_id)
    assert "no-such-model" in by_id["gone"].error_message
    assert "at least one input" in by_id["empty"].error_message
    for rid, (folder, x, mask) in sent.items():
        assert by_id[rid].error_message == "", by_id[rid].error_message
        got = _encoded(by_id[rid].infer_response)
        np.testing.assert_allclose(got, reference(model_repository / folder, x, mask), rtol=0, atol=1e-6)
    asked = urllib.request.Request(f"http://127.0.0.1:{repo_server.port}/metrics", headers=AUTH)
    metrics = urllib.request.urlopen(asked, timeout=5).read().decode()
    route = 'method="GRPC",route="/inference.GRPCInferenceService/ModelStreamInfer"'
    assert f'addnorm_requests_total{{{route},status="OK"}}' in metrics
    assert f'addnorm_requests_total{{{route},status="NOT_FOUND"}}' in metrics


def test_tritonclients_stream_api_and_the_final_response_mark(repo_server, model_repository):
    """start_stream / async_stream_infer as Triton's users call them; enable_empty_final_response marks the
    answer final (every answer of a model addnorm serves is its last)."""
    client = tg.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=AUTH)
    x = np.random.default_rng(4).standard_normal((1, 9, E)).astype(np.float32)
    client.async_stream_infer("encoder", [_input(x)], request_id="a", enable_empty_final_response=True)
    client.async_stream_infer("encoder", [_input(x, "nope")], request_id="b")
    client.async_stream_infer("encoder", [_input(x)], request_id="c")
    got = [answers.get(timeout=30) for _ in range(3)]
    client.stop_stream()
    client.close()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [str(e) for r, e in got if e is not None]
    assert sorted(results) == ["a", "c"] and len(errors) == 1 and "unknown input 'nope'" in errors[0]
    final = results["a"].get_response().parameters["triton_final_response"]
    assert final.bool_param is True and "triton_final_response" not in results["c"].get_response().parameters
    for r in results.values():
        np.testing.assert_allclose(
            r.as_numpy("encoded"), reference(model_repository / "a-fp32", x), rtol=0, atol=1e-6
        )


def test_tritonclient_aio_stream_and_the_guard(repo_server, model_repository):
    """tritonclient.grpc.aio's stream_infer; a stream without the API key is refused (UNAUTHENTICATED), as a
    ModelInfer call is."""
    x = np.random.default_rng(5).standard_normal((1, 5, E)).astype(np.float32)

    async def main(headers):
        async with tga.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}") as client:

            async def requests():
                for i in range(4):
                    yield {"model_name": "encoder-int8", "inputs": [_input(x)], "request_id": str(i)}

            return [item async for item in client.stream_infer(requests(), headers=headers)]

    got = asyncio.run(main(AUTH))
    assert sorted(r.get_response().id for r, e in got) == ["0", "1", "2", "3"]
    want = reference(model_repository / "b-int8", x)
    for result, error in got:
        assert error is None
        np.testing.assert_allclose(result.as_numpy("encoded"), want, rtol=0, atol=1e-6)
    with grpc.insecure_channel(f"127.0.0.1:{repo_server.grpc_port}") as channel:  # no key
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ModelStreamInfer(iter(()), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


class _Context:
    """A ModelStreamInfer call's context: ``messages`` to read (then EOF, or nothing more when ``hold``)."""

    def __init__(self, messages: list[bytes], hold: bool = False) -> None:
        self.messages, self.hold = list(messages), hold
        self.written: list[pb.ModelStreamInferResponse] = []
        self.aborted: tuple | None = None

    async def read(self):
        if self.messages:
            return self.messages.pop(0)
        if self.hold:
            await asyncio.Event().wait()
        return grpc.aio.EOF

    async def write(self, message: bytes) -> None:
        self.written.append(pb.ModelStreamInferResponse.FromString(message))

    async def abort(self, code, message):
        self.aborted = (code, message)


class _Service:
    """ModelInfer that waits until released, counting the requests in progress."""

    def __init__(self) -> None:
        self.running = self.most = 0
        self.release = asyncio.Event()
        self.cancelled = 0

    async def ModelInfer(self, request, context) -> bytes:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
            if request.model_name == "bad":
                raise BadInput("bad model")
            return pb.ModelInferResponse(id=request.id, model_name=request.model_name).SerializeToString()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1


# the service state the stream reads: the request metrics and whether to write access lines
_State = SimpleNamespace(
    metrics=SimpleNamespace(observe_request=lambda route, method, status, seconds: None),
    settings=SimpleNamespace(access_log=False),
)


def _messages(*names: str) -> list[bytes]:
    return [
        pb.ModelInferRequest(model_name=n, id=f"{n}-{i}").SerializeToString() for i, n in enumerate(names)
    ]


def test_the_stream_reads_no_more_than_its_in_flight_limit_and_answers_all_before_it_ends(monkeypatch):
    monkeypatch.setattr(grpc_stream, "IN_FLIGHT", 2)

    async def main():
        service, context = _Service(), _Context([*_messages("m", "m", "bad", "m", "m"), b"\xff garbage"])
        task = asyncio.create_task(grpc_stream.handler(service.ModelInfer, _State, "/r")(None, context))
        await asyncio.sleep(0.05)
        assert service.most == 2 and len(context.messages) == 4  # two read, in progress; the rest waits
        service.release.set()
        await asyncio.wait_for(task, 5)
        return service, context

    service, context = asyncio.run(main())
    assert service.most == 2 and context.aborted is None  # ended by the client (EOF): status OK
    answered = {r.infer_response.id: r.error_message for r in context.written}
    assert answered == {"m-0": "", "m-1": "", "bad-2": "bad model", "m-3": "", "m-4": "", "": answered[""]}
    assert "not a valid ModelInferRequest" in answered[""]


def test_an_idle_stream_ends_and_a_cancelled_one_drops_its_requests(monkeypatch):
    monkeypatch.setattr(grpc_stream, "IDLE_S", 0.05)

    async def idle():
        context = _Context([], hold=True)
        await asyncio.wait_for(grpc_stream.handler(_Service().ModelInfer, _State, "/r")(None, context), 5)
        return context

    context = asyncio.run(idle())
    assert context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "no request" in context.aborted[1]

    async def cancelled():
        service, context = _Service(), _Context(_messages("m", "m", "m"), hold=True)
        task = asyncio.create_task(grpc_stream.handler(service.ModelInfer, _State, "/r")(None, context))
        await asyncio.sleep(0.2)  # longer than IDLE_S: a stream with requests in progress is not idle
        assert service.running == 3 and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no request and no pending read left behind
        return service

    service = asyncio.run(cancelled())
    assert service.cancelled == 3 and service.running == 0


def test_a_client_cancelling_its_stream_leaves_the_server_serving(repo_server, model_repository):
    """A stream cancelled with requests in progress (a client gone mid-stream, on the real server): the server
    drops them and answers the next stream and the next call as before."""
    x = np.random.default_rng(6).standard_normal((4, 64, E)).astype(np.float32)
    raw = _request("encoder", x, "c").SerializeToString()
    target = f"127.0.0.1:{repo_server.grpc_port}"

    async def cancel_mid_stream():
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
                metadata=tuple(AUTH.items())
            )
            for _ in range(20):
                await call.write(raw)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()

    for _ in range(3):
        asyncio.run(cancel_mid_stream())
    with grpc.insecure_channel(target) as channel:
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        [answer] = stub.ModelStreamInfer(
            iter([_request("encoder", x, "after")]), metadata=tuple(AUTH.items())
        )
        single = stub.ModelInfer(_request("encoder", x, "call"), metadata=tuple(AUTH.items()))
    want = reference(model_repository / "a-fp32", x)
    np.testing.assert_allclose(_encoded(answer.infer_response), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_encoded(single), want, rtol=0, atol=1e-6)
    assert repo_server.proc.poll() is None


def test_streams_opened_and_abandoned_by_the_hundred_leave_nothing_behind(tiny_artifact):
    """Clients that open a stream, send five 32 kB requests and cancel it (some before any answer, some after one),
    600 times, 30 at a time: the server's memory levels off (the second 300 add under half of what keeping their
    requests would: 48 MB; alone they add 4-6 MB, on a 2-core machine busy with the rest of the suite up to 18 MB,
    the allocator's high-water mark, not a leak) and a stream afterwards is answered right."""
    from bench.reliability import proc_rss_mb as rss_mb
    from tests.conftest import start_server

    x = np.ones((1, 256, 32), np.float32)
    raw = _request("encoder", x, "churn").SerializeToString()
    raw_mb = len(raw) / 2**20

    async def churn(target: str, n: int) -> None:
        async def one(i: int) -> None:
            async with grpc.aio.insecure_channel(target) as channel:
                call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")()
                for _ in range(5):
                    await call.write(raw)
                if i % 2:
                    await call.read()
                call.cancel()

        for start in range(0, n, 30):
            await asyncio.gather(*(one(i) for i in range(start, start + 30)))

    with start_server(tiny_artifact, grpc=True) as srv:
        target = f"127.0.0.1:{srv.grpc_port}"
        asyncio.run(churn(target, 300))
        first = rss_mb(srv.proc.pid)
        asyncio.run(churn(target, 300))
        second = rss_mb(srv.proc.pid)
        with grpc.insecure_channel(target) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            [answer] = stub.ModelStreamInfer(iter([_request("encoder", x, "after")]), timeout=30)
        assert answer.error_message == "" and answer.infer_response.id == "after"
        assert srv.proc.poll() is None
    held_mb = 300 * 5 * raw_mb  # the second 300's requests, were they kept
    assert second - first < held_mb / 2, (first, second, held_mb)
