"""Hostile input: every field of both protocols type-confused, every header the service reads malformed, and
property-based documents; each gets a 4xx that names what is wrong, never a 500."""

import copy
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from addnorm.model.artifact import Manifest
from addnorm.service import create_app
from addnorm.service.errors import ServiceError, http_status
from addnorm.service.protocols.v1 import codec as codec_v1
from addnorm.service.protocols.v2 import codec as codec_v2
from addnorm.service.settings import Settings
from tests.helpers import wait_until_ready

D = 32
HOSTILE = ([1], {"a": 1}, None, 3, True, "x" * 100_000)  # list, object, null, number, bool, a long string
V2_DOC = {
    "id": "r1",
    "parameters": {"timeout": 5_000_000, "binary_data_output": False},
    "inputs": [
        {
            "name": "embeddings",
            "shape": [1, 2, D],
            "datatype": "FP32",
            "data": [0.5] * 2 * D,
            "parameters": {},
        },
        {"name": "mask", "shape": [1, 2], "datatype": "BOOL", "data": [False, True]},
    ],
    "outputs": [{"name": "encoded", "parameters": {"binary_data": False}}],
}
# path in the document -> the word the error must contain
V2_FIELDS = {
    ("id",): "id",
    ("parameters",): "parameters",
    ("parameters", "timeout"): "timeout",
    ("parameters", "binary_data_output"): "binary_data_output",
    ("inputs",): "inputs",
    ("inputs", 0): "inputs[0]",
    ("inputs", 0, "name"): "name",
    ("inputs", 0, "shape"): "shape",
    ("inputs", 0, "datatype"): "datatype",
    ("inputs", 0, "data"): "data",
    ("inputs", 0, "parameters"): "parameters",
    ("inputs", 0, "parameters", "binary_data_size"): "binary_data_size",
    ("inputs", 1, "data"): "data",
    ("outputs",): "outputs",
    ("outputs", 0): "outputs[0]",
    ("outputs", 0, "name"): "name",
    ("outputs", 0, "parameters"): "parameters",
    ("outputs", 0, "parameters", "binary_data"): "binary_data",
}
# (path, value) pairs that are valid input, not hostile: optional fields set to null, a string id, a 3 us timeout,
# extra keys in a parameters object (the protocol's parameters are an open map), and true where a boolean belongs
_OPTIONAL = (
    "id",
    "parameters",
    "timeout",
    "binary_data_output",
    "outputs",
    "binary_data_size",
    "binary_data",
)
V2_ACCEPTED = (
    [(p, None) for p in V2_FIELDS if p[-1] in _OPTIONAL]
    + [(p, {"a": 1}) for p in V2_FIELDS if p[-1] == "parameters"]
    + [(p, True) for p in V2_FIELDS if p[-1] in ("binary_data_output", "binary_data")]
    + [(("id",), "x" * 100_000), (("parameters", "timeout"), 3)]
)


@pytest.fixture(scope="module")
def manifest(tiny_artifact):
    return Manifest.load(tiny_artifact)


def _set(doc: dict, path: tuple, value: object) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize("path", list(V2_FIELDS), ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("value", HOSTILE, ids=["list", "object", "null", "number", "bool", "long-string"])
def test_v2_every_field_type_confused_is_a_4xx_naming_it(manifest, path, value):
    body = json.dumps(_set(V2_DOC, path, value)).encode()
    try:
        req = codec_v2.decode_infer(body, None, manifest, 10_000)
    except ServiceError as exc:
        assert 400 <= http_status(exc) < 500
        assert V2_FIELDS[path] in exc.message, exc.message
        assert len(exc.message) < 400  # a hostile value is never echoed whole
    else:
        assert (path, value) in V2_ACCEPTED, f"{path} = {str(value)[:20]} was accepted"
        assert req.embeddings.shape == (1, 2, D)


@pytest.mark.parametrize("field", ["embeddings", "mask"])
@pytest.mark.parametrize("value", HOSTILE, ids=["list", "object", "null", "number", "bool", "long-string"])
def test_v1_every_field_type_confused_is_a_4xx_naming_it(field, value):
    doc = {"embeddings": [[0.5] * D] * 2, "mask": [False, True], field: value}
    try:
        codec_v1.decode("application/json", json.dumps(doc).encode(), None, D, 10_000)
    except ServiceError as exc:
        assert 400 <= http_status(exc) < 500 and field in exc.message, exc.message
        assert len(exc.message) < 400
    else:
        assert (field, value) == ("mask", None)  # no mask is a valid request


def test_booleans_are_json_booleans(manifest):
    """Regression: "binary_data_output": "false" (a string) was read as true."""
    for path in (("parameters", "binary_data_output"), ("outputs", 0, "parameters", "binary_data")):
        for value in ("false", "true", 0, 1):
            with pytest.raises(ServiceError, match="must be true or false"):
                codec_v2.decode_infer(json.dumps(_set(V2_DOC, path, value)).encode(), None, manifest, 10_000)
    req = codec_v2.decode_infer(json.dumps(V2_DOC).encode(), None, manifest, 10_000)
    assert req.outputs == [codec_v2.RequestedOutput("encoded", False)]


def test_unhashable_names_and_datatypes_are_400_not_500(manifest):
    """Regression: a list or object as an input's name or datatype raised TypeError (unhashable) -> 500."""
    for path in (("inputs", 0, "name"), ("inputs", 0, "datatype")):
        for value in ([1], {"a": 1}):
            with pytest.raises(ServiceError) as info:
                codec_v2.decode_infer(json.dumps(_set(V2_DOC, path, value)).encode(), None, manifest, 10_000)
            assert http_status(info.value) == 400


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
V2_KEYS = st.sampled_from(["id", "parameters", "inputs", "outputs", "name", "shape", "datatype", "data",
                           "binary_data_size", "binary_data", "binary_data_output", "timeout", "x"])  # fmt: skip


def _mutated_v2(draw_value, doc=V2_DOC):
    """V2_DOC with one field anywhere replaced by an arbitrary JSON value."""
    return st.sampled_from(list(V2_FIELDS)).flatmap(lambda p: draw_value.map(lambda v: _set(doc, p, v)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_mutated_v2(JSON_VALUES) | st.dictionaries(V2_KEYS, JSON_VALUES, max_size=5))
def test_v2_codec_property_only_4xx(manifest, doc):
    try:
        req = codec_v2.decode_infer(json.dumps(doc).encode(), None, manifest, 10_000)
    except ServiceError as exc:
        assert 400 <= http_status(exc) < 500 and exc.message
    else:
        assert (
            req.embeddings.dtype == np.float32 and req.embeddings.ndim == 3 and req.embeddings.shape[-1] == D
        )


@settings(max_examples=300, deadline=None)
@given(doc=st.fixed_dictionaries({}, optional={"embeddings": JSON_VALUES, "mask": JSON_VALUES, "x": JSON_VALUES})
       | JSON_VALUES)  # fmt: skip
def test_v1_codec_property_only_4xx(doc):
    try:
        req = codec_v1.decode("application/json", json.dumps(doc).encode(), None, D, 10_000)
    except ServiceError as exc:
        assert 400 <= http_status(exc) < 500 and exc.message
    else:
        assert req.embeddings.ndim == 3 and req.embeddings.shape[-1] == D


@pytest.fixture(scope="module")
def client(tiny_artifact):
    with TestClient(create_app(Settings(artifact=tiny_artifact)), raise_server_exceptions=False) as c:
        wait_until_ready(c)
        yield c


RAW = np.zeros((1, 2, D), "<f4").tobytes()
V1_BINARY = {"content-type": "application/octet-stream", "x-shape": f"1,2,{D}"}
HEADER_CASES = [  # (route, body, headers, the header the error must name)
    ("/v1/encode", RAW, {**V1_BINARY, "x-shape": "a,b"}, "X-Shape"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-shape": "1,2,3,4"}, "X-Shape"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-shape": "-1,2,32"}, "X-Shape"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-shape": "9" * 5000}, "X-Shape"),
    ("/v1/encode", RAW, {"content-type": "application/octet-stream"}, "X-Shape"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-lengths": "x"}, "X-Lengths"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-lengths": "0"}, "X-Lengths"),
    ("/v1/encode", RAW, {**V1_BINARY, "x-lengths": "1,1"}, "X-Lengths"),
    ("/v1/encode", RAW, {**V1_BINARY, "accept": "text/html"}, "accept"),
    ("/v1/encode", RAW, {"content-type": "text/csv"}, "Content-Type"),
    ("/v2/models/encoder/infer", b"{}", {"inference-header-content-length": "x"}, "Inference-Header-Content-Length"),
    ("/v2/models/encoder/infer", b"{}", {"inference-header-content-length": "-1"}, "Inference-Header-Content-Length"),
    ("/v2/models/encoder/infer", b"{}", {"inference-header-content-length": "99"}, "Inference-Header-Content-Length"),
    ("/v2/models/encoder/infer", b"{}", {"content-encoding": "br"}, "Content-Encoding"),
    ("/v2/models/encoder/infer", b"not gzip", {"content-encoding": "gzip"}, "gzip"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "headers", "named"), HEADER_CASES)
def test_malformed_headers_get_a_4xx_naming_the_header(client, route, body, headers, named):
    r = client.post(route, content=body, headers=headers)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert set(r.json()) == {"error"} and named.lower() in r.json()["error"].lower(), r.json()
