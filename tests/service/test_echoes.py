"""Every echo bounded: what a client sent comes back in an error cut to a few hundred bytes, on both transports,
and no error shows the repr of the server's own objects (issue 24)."""

import io

import grpc
import httpx
import numpy as np
import pytest

from addnorm.service.errors import MAX_MESSAGE, BadInput, bounded, quote
from addnorm.service.protocols.v2 import inference_pb2 as pb
from tests.conftest import REPO_KEY

AUTH = {"authorization": f"Bearer {REPO_KEY}"}
LONG = "x" * 150_000  # under the repository server's 200 kB body limit


def test_quote_cuts_and_marks_and_costs_little():
    assert quote("encoder") == "'encoder'"
    long = quote("y" * 10_000_000)
    assert long.endswith("...(cut)") and len(long) < 60
    assert len(quote(list(range(10**6)), limit=200)) < 220  # reprlib: never the whole list
    assert quote(object()).startswith("<object object at")  # (the codecs only quote parsed literals)


def test_every_domain_error_message_is_bounded():
    message = BadInput("a" * 10_000 + "the end").message
    assert len(message) <= MAX_MESSAGE and message.endswith("the end") and "characters cut" in message
    assert bounded("short") == "short"


@pytest.mark.parametrize(
    "how",
    [
        lambda base: httpx.post(
            f"{base}/v1/encode", json={"model": LONG, "embeddings": [[0.5] * 32]}, headers=AUTH
        ),
        lambda base: httpx.post(
            f"{base}/v1/encode?model={LONG[:6000]}", json={"embeddings": [[0.5] * 32]}, headers=AUTH
        ),
        lambda base: httpx.get(f"{base}/v2/models/{LONG[:6000]}", headers=AUTH),
        lambda base: httpx.get(f"{base}/v2/models/encoder/versions/{LONG[:6000]}", headers=AUTH),
    ],
    ids=["v1 body", "v1 query", "v2 name", "v2 version"],
)
def test_a_long_name_or_version_over_http_is_cut_in_its_404(repo_server, how):
    r = how(repo_server.base)
    assert r.status_code == 404, r.text[:200]
    assert len(r.content) < 600 and "...(cut)" in r.json()["error"]


def test_a_long_name_or_version_over_grpc_is_not_found_not_a_removed_stream(repo_server):
    """A status bigger than the metadata limit reached the client as RESOURCE_EXHAUSTED: Stream removed."""
    with grpc.insecure_channel(f"127.0.0.1:{repo_server.grpc_port}") as channel:
        metadata = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        for request in (
            pb.ModelMetadataRequest(name=LONG),
            pb.ModelMetadataRequest(name="encoder", version=LONG),
        ):
            with pytest.raises(grpc.RpcError) as info:
                metadata(request, metadata=list(AUTH.items()), timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert len(info.value.details()) < 600 and "...(cut)" in info.value.details()


def test_a_npy_header_holding_an_expression_gets_words_not_a_memory_address(repo_server):
    buf = io.BytesIO()
    np.save(buf, np.zeros((1, 32), np.float32))
    good = buf.getvalue()
    header_end = good.index(b"\n", 10)
    hostile = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 32), 'x': object()}"
    header = hostile.ljust(header_end - 10, b" ")
    body = good[:10] + header + good[header_end:]
    assert len(body) == len(good)
    r = httpx.post(
        f"{repo_server.base}/v1/encode", content=body, headers={**AUTH, "content-type": "application/x-npy"}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert "0x" not in error and "object" not in error and "dict literal" in error, error
