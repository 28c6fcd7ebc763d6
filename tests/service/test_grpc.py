"""The Open Inference Protocol over gRPC, with the real tritonclient.grpc (sync and aio) against a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.grpc import model_config_pb2 as triton_mc
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from addnorm.model.packing import answered
from addnorm.service.guard import Guard
from addnorm.service.models.state import ServiceState
from addnorm.service.protocols import MODEL_PREFIXES, PUBLIC_PATHS
from addnorm.service.protocols.v2 import grpc_server
from addnorm.service.protocols.v2 import inference_pb2 as pb
from addnorm.service.settings import Settings
from bench.server import free_port
from tests.conftest import REPO_KEY as KEY

AUTH = {"authorization": f"Bearer {KEY}"}
E = 32


@pytest.fixture(scope="module")
def client(repo_server):
    c = tg.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}")
    yield c
    c.close()


def reference(model_dir: Path, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """In-process onnxruntime on the artifact's graph: what every answer must equal (zeros where a row's trailing
    padding is, which the server does not compute)."""
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"embeddings": x, "mask": np.zeros(x.shape[:2], bool) if mask is None else mask}
    return answered(sess.run(["encoded"], feeds)[0], mask)


def _input(x: np.ndarray, name: str = "embeddings", datatype: str = "FP32") -> tg.InferInput:
    i = tg.InferInput(name, list(x.shape), datatype)
    i.set_data_from_numpy(x)
    return i


def _code(fn) -> grpc.StatusCode:
    """The status a call failed with (tritonclient reports it as the text 'StatusCode.NAME')."""
    with pytest.raises(InferenceServerException) as info:
        fn()
    return grpc.StatusCode[info.value.status().removeprefix("StatusCode.")]


def test_messages_match_tritonclients_wire_format():
    """Every message we define has tritonclient's field names, numbers, types and cardinality."""

    def fields(d):
        return {
            f.name: (f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else None)
            for f in d.fields
        }

    def compare(ours, theirs):
        mine, other = fields(ours), fields(theirs)
        assert set(mine) <= set(other), ours.full_name
        for name, (number, kind, repeated, msg) in mine.items():
            assert (number, kind, repeated) == other[name][:3], f"{ours.full_name}.{name}"
            if msg and msg != "ParametersEntry":
                assert msg == other[name][3]
        for nested in ours.nested_types:
            compare(nested, theirs.nested_types_by_name[nested.name])
        for enum in ours.enum_types:
            other_enum = theirs.enum_types_by_name[enum.name]
            assert {v.name: v.number for v in enum.values} == {v.name: v.number for v in other_enum.values}

    theirs = {**triton_mc.DESCRIPTOR.message_types_by_name, **triton_pb.DESCRIPTOR.message_types_by_name}
    assert pb.DESCRIPTOR.message_types_by_name
    for name, ours in pb.DESCRIPTOR.message_types_by_name.items():
        compare(ours, theirs[name])
    for (
        name,
        ours,
    ) in pb.DESCRIPTOR.enum_types_by_name.items():  # DataType: the same numbers for the same names
        assert {v.name: v.number for v in ours.values} == {
            v.name: v.number for v in triton_mc.DESCRIPTOR.enum_types_by_name[name].values
        }
    service = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == grpc_server.SERVICE
    for method, request in grpc_server._METHODS.items():
        assert service.methods_by_name[method].input_type.name == request.DESCRIPTOR.name


def test_health_and_metadata(client, model_repository):
    assert client.is_server_live() and client.is_server_ready()  # open, like the health probes
    assert client.is_model_ready("encoder", headers=AUTH) and client.is_model_ready(
        "encoder-int8", headers=AUTH
    )
    meta = client.get_server_metadata(headers=AUTH, as_json=True)
    assert meta["name"] == "addnorm" and "statistics" in meta["extensions"]
    model = client.get_model_metadata("encoder-int8", headers=AUTH, as_json=True)
    assert model["name"] == "encoder-int8" and model["versions"] == ["1"]
    assert [i["name"] for i in model["inputs"]] == ["embeddings", "mask"]
    assert model["outputs"][0]["shape"] == ["-1", "-1", str(E)]


def test_each_model_answers_with_its_own_graph(client, model_repository):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, E)).astype(np.float32)
    mask = np.zeros((3, 7), bool)
    mask[1, 4:] = True
    answers = {}
    for name, folder in (("encoder", "a-fp32"), ("encoder-int8", "b-int8")):
        inputs = [_input(x), _input(mask, "mask", "BOOL")]
        result = client.infer(name, inputs, headers=AUTH, request_id="r-7")
        got = result.as_numpy("encoded")
        np.testing.assert_allclose(got, reference(model_repository / folder, x, mask), rtol=0, atol=1e-6)
        assert result.get_response().model_name == name and result.get_response().id == "r-7"
        answers[name] = got
    assert np.abs(answers["encoder"] - answers["encoder-int8"]).max() > 1e-2  # two graphs, two answers


def test_typed_contents_are_read_like_raw_ones(repo_server, model_repository):
    """A client that sends fp32_contents (not raw bytes) gets the same answer."""
    x = np.random.default_rng(1).standard_normal((2, 5, E)).astype(np.float32)
    request = triton_pb.ModelInferRequest(model_name="encoder")
    tensor = request.inputs.add(name="embeddings", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(f"127.0.0.1:{repo_server.grpc_port}") as channel:
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, metadata=tuple(AUTH.items()))
        got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)
        np.testing.assert_allclose(got, reference(model_repository / "a-fp32", x), rtol=0, atol=1e-6)
        fp16 = triton_pb.ModelInferRequest(model_name="encoder")
        fp16.inputs.add(name="embeddings", datatype="FP16", shape=[1, 1, E])
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(fp16, metadata=tuple(AUTH.items()))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents" in info.value.details()


def test_every_error_class_has_its_status_code(client):
    x = np.zeros((1, 4, E), np.float32)
    ok = [_input(x)]
    assert _code(lambda: client.infer("encoder", ok)) == grpc.StatusCode.UNAUTHENTICATED
    wrong = {"authorization": "Bearer nope"}
    assert _code(lambda: client.infer("encoder", ok, headers=wrong)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: client.get_model_metadata("encoder")) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: client.infer("nope", ok, headers=AUTH)) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.infer("encoder", ok, "7", headers=AUTH)) == grpc.StatusCode.NOT_FOUND
    narrow = [_input(np.zeros((1, 4, 3), np.float32))]
    assert _code(lambda: client.infer("encoder", narrow, headers=AUTH)) == grpc.StatusCode.INVALID_ARGUMENT
    stranger = [_input(x), _input(x, "other")]
    assert _code(lambda: client.infer("encoder", stranger, headers=AUTH)) == grpc.StatusCode.INVALID_ARGUMENT
    nan = x.copy()
    nan[0, 0, 0] = np.nan
    assert (
        _code(lambda: client.infer("encoder", [_input(nan)], headers=AUTH))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    big = [_input(np.zeros((2, 1024, E), np.float32))]  # 262 kB: above --max-body-bytes 200000
    assert _code(lambda: client.infer("encoder", big, headers=AUTH)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The request's own timeout (microseconds) is shorter than any run: the server answers DEADLINE_EXCEEDED.
    slow = [_input(np.zeros((4, 256, E), np.float32))]
    code = _code(lambda: client.infer("encoder", slow, headers=AUTH, timeout=1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client's own deadline (100 us) passes first: grpcio reports DEADLINE_EXCEEDED on the client whatever the
    # server did with the call (it may never have seen it), so what is checked is that the server is unharmed.
    code = _code(lambda: client.infer("encoder", slow, headers=AUTH, client_timeout=1e-4))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.is_server_ready()  # nothing above hurt the server
    np.testing.assert_array_equal(
        client.infer("encoder", ok, headers=AUTH).as_numpy("encoded").shape, (1, 4, E)
    )


def test_aio_client_concurrent_calls(repo_server, model_repository):
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1, int(n), E)).astype(np.float32) for n in rng.integers(2, 12, 16)]

    async def main() -> list[np.ndarray]:
        async with tga.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}") as c:
            assert await c.is_server_ready()
            calls = []
            for x in xs:
                i = tga.InferInput("embeddings", list(x.shape), "FP32")
                i.set_data_from_numpy(x)
                calls.append(c.infer("encoder", [i], headers=AUTH))
            return [r.as_numpy("encoded") for r in await asyncio.gather(*calls)]

    for x, got in zip(xs, asyncio.run(main()), strict=True):
        # merged into batches or not, each answer is its own (every variant: tests/export/test_matrix.py)
        np.testing.assert_allclose(got, reference(model_repository / "a-fp32", x), rtol=0, atol=1e-5)


def test_statistics_count_each_request(client):
    def stats() -> dict:
        return client.get_inference_statistics("encoder", headers=AUTH, as_json=True)["model_stats"][0]

    before = stats()
    x = np.ones((2, 3, E), np.float32)
    for _ in range(3):
        client.infer("encoder", [_input(x)], headers=AUTH)
    with pytest.raises(InferenceServerException):
        client.infer("encoder", [_input(np.ones((1, 3, 5), np.float32))], headers=AUTH)
    after = stats()
    s0, s1 = before["inference_stats"], after["inference_stats"]
    assert int(s1["success"]["count"]) - int(s0.get("success", {}).get("count", 0)) == 3
    assert int(s1["fail"]["count"]) - int(s0.get("fail", {}).get("count", 0)) == 1
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 6  # rows
    assert int(s1["compute_infer"]["ns"]) > int(s0.get("compute_infer", {}).get("ns", 0))
    assert any(int(b["batch_size"]) == 2 for b in after["batch_stats"])
    both = client.get_inference_statistics(headers=AUTH, as_json=True)["model_stats"]
    assert sorted(m["name"] for m in both) == ["encoder", "encoder-int8"]
    index = client.get_model_repository_index(headers=AUTH, as_json=True)["models"]
    assert [(m["name"], m["state"]) for m in index] == [("encoder", "READY"), ("encoder-int8", "READY")]


def test_unavailable_while_loading_and_port_in_use():
    """The service before any model is read answers UNAVAILABLE; a second server on a taken port fails clearly."""

    async def main() -> None:
        state = ServiceState(Settings(artifact="nowhere", grpc_port=free_port()))
        guard = Guard(state, PUBLIC_PATHS, MODEL_PREFIXES)  # what create_app gives it
        server = await grpc_server.start(state, guard)
        try:
            async with tga.InferenceServerClient(f"127.0.0.1:{state.settings.grpc_port}") as c:
                assert await c.is_server_live() and not await c.is_server_ready()
                i = tga.InferInput("embeddings", [1, 1, E], "FP32")
                i.set_data_from_numpy(np.zeros((1, 1, E), np.float32))
                with pytest.raises(InferenceServerException) as info:
                    await c.infer("encoder", [i])
                assert info.value.status() == "StatusCode.UNAVAILABLE"
                assert "loading" in info.value.message()
            with pytest.raises(OSError, match="is the port in use"):
                await grpc_server.start(state, guard)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_model_config_over_both_transports_is_one_document(client, repo_server):
    """Triton's ModelConfig, as perf_analyzer and tritonclient read it: the same over HTTP and gRPC, with the
    server's real batching limits and the mask optional (a request may leave it out)."""
    import httpx
    from google.protobuf import json_format

    http = httpx.get(f"{repo_server.base}/v2/models/encoder/config", headers=AUTH).json()
    assert http == httpx.get(f"{repo_server.base}/v2/models/encoder/versions/1/config", headers=AUTH).json()
    got = client.get_model_config("encoder", headers=AUTH)
    assert json_format.MessageToDict(
        got.config, preserving_proto_field_name=True
    ) == json_format.MessageToDict(
        json_format.ParseDict(http, triton_mc.ModelConfig()), preserving_proto_field_name=True
    )
    config = got.config
    assert (
        config.name == "encoder" and config.platform == "onnxruntime_onnx" and config.backend == "onnxruntime"
    )
    assert config.max_batch_size == 32  # the server's default --max-batch-size
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("embeddings", triton_mc.TYPE_FP32, [-1, E], False),
        ("mask", triton_mc.TYPE_BOOL, [-1], True),
    ]
    assert [(o.name, list(o.dims)) for o in config.output] == [("encoded", [-1, E])]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 256
    assert [(g.kind, g.count) for g in config.instance_group] == [(triton_mc.ModelInstanceGroup.KIND_CPU, 1)]
    assert _code(lambda: client.get_model_config("nope", headers=AUTH)) == grpc.StatusCode.NOT_FOUND
    assert (
        httpx.get(f"{repo_server.base}/v2/models/encoder/versions/2/config", headers=AUTH).status_code == 404
    )


@pytest.mark.unit
def test_the_answer_written_by_hand_is_the_message_protobuf_writes():
    """encode_infer writes raw_output_contents itself (one copy of the tensor): protobuf reads back exactly the
    message it would have serialized, for one output and several, small and past a 2-byte varint."""
    import numpy as np

    from addnorm.service.protocols.v2 import codec, grpc_codec
    from addnorm.service.protocols.v2 import inference_pb2 as pb

    for shapes in ([(1, 2, 4)], [(8, 128, 768), (3, 5, 1)]):
        outs = {
            f"o{i}": np.random.default_rng(i).standard_normal(s).astype(np.float32)
            for i, s in enumerate(shapes)
        }
        req = codec.InferRequest(
            id="x7",
            embeddings=None,
            mask=None,
            outputs=[codec.RequestedOutput(n, True) for n in outs],
            timeout_s=None,
        )
        got = pb.ModelInferResponse.FromString(grpc_codec.encode_infer(req, "enc", outs, "2"))
        want = pb.ModelInferResponse(model_name="enc", model_version="2", id="x7")
        for n, a in outs.items():
            want.outputs.add(name=n, datatype="FP32", shape=a.shape)
            want.raw_output_contents.append(a.tobytes())
        assert got == want
