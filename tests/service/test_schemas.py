"""The JSON shapes each protocol documents (service/protocols/*/schema.py, from which /openapi.json is built) are the
ones its codec reads and writes: every field a request may carry is read, no field is read that is not
documented, and an answer writes every documented field and nothing else. The codec reads through recording JSON
objects here, so a field added to one side only fails this test. (schemathesis checks the served answers against
the same document: tests/test_schemathesis.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import orjson
import pytest

from addnorm.model.artifact import Manifest
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, OUTPUT_NAMES, POOLED, SCORES, SPARSE
from addnorm.service.protocols.v1 import codec as v1
from addnorm.service.protocols.v1 import schema as v1_schema
from addnorm.service.protocols.v2 import codec as v2
from addnorm.service.protocols.v2 import schema as v2_schema

Path = tuple[str, ...]  # keys from the document's root, "[]" for any item of an array


def documented(schema: dict, path: Path = ()) -> set[Path]:
    """Every object key a JSON schema declares, by its path."""
    keys: set[Path] = set()
    for name, sub in schema.get("properties", {}).items():
        keys |= {path + (name,)} | documented(sub, path + (name,))
    if "items" in schema:
        keys |= documented(schema["items"], path + ("[]",))
    for sub in schema.get("anyOf", ()):
        keys |= documented(sub, path)
    return keys


def written(doc: object, path: Path = ()) -> set[Path]:
    """Every object key a JSON document holds, by its path."""
    if isinstance(doc, dict):
        return {path + (k,) for k in doc} | {p for k, v in doc.items() for p in written(v, path + (k,))}
    if isinstance(doc, list):
        return {p for item in doc for p in written(item, path + ("[]",))}
    return set()


class Recording(dict):
    """A JSON object that notes in ``reads`` the path of every key looked up in it (present or not)."""

    def __init__(self, data: dict, path: Path, reads: set[Path]) -> None:
        super().__init__({k: _wrap(v, path + (k,), reads) for k, v in data.items()})
        self.path, self.reads = path, reads

    def __getitem__(self, key):
        self.reads.add(self.path + (key,))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.reads.add(self.path + (key,))
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.reads.add(self.path + (key,))
        return super().__contains__(key)


def _wrap(value: object, path: Path, reads: set[Path]) -> object:
    if isinstance(value, dict):
        return Recording(value, path, reads)
    if isinstance(value, list) and value and isinstance(value[0], dict | list):
        return [_wrap(v, path + ("[]",), reads) for v in value]
    return value


@pytest.fixture
def reads(monkeypatch) -> set[Path]:
    """The keys the codecs read from every request decoded while the test runs."""
    seen: set[Path] = set()
    for module in (v1, v2):
        parse = module.parse_json
        monkeypatch.setattr(
            module, "parse_json", lambda body, limit, parse=parse: _wrap(parse(body, limit), (), seen)
        )
    return seen


@pytest.fixture(scope="module")
def manifest(tiny_artifact) -> Manifest:
    return Manifest.load(tiny_artifact)


def test_v1_reads_exactly_the_documented_request_fields(reads):
    width = 4
    full = {EMBEDDINGS: [[[0.5] * width] * 2], MASK: [[False, True]], "model": "encoder"}
    v1.decode(v1.JSON, json.dumps(full).encode(), None, width, 10_000)
    assert reads == documented(v1_schema.REQUEST)


class RecordingHeaders(dict):
    """Request headers that note every name looked up."""

    def __init__(self, data: dict, reads: set[str]) -> None:
        super().__init__(data)
        self.reads = reads

    def get(self, key, default=None):
        self.reads.add(key)
        return super().get(key, default)


def test_v1_reads_exactly_the_documented_headers_and_query():
    width, read = 4, set()
    body = np.zeros((2, 3, width), np.float32).tobytes()
    headers = RecordingHeaders({"x-shape": f"2,3,{width}", "x-lengths": "3,2"}, read)
    codec = v1.EncodeCodec(v1.OCTET, headers, None, v1.JSON, None, 10_000)
    req = codec.decode(body, lambda name: SimpleNamespace(engine=SimpleNamespace(d_model=width)))
    assert req.mask is not None and read == v1_schema.HEADERS
    query = {p["name"] for p in v1_schema.PARAMETERS if p["in"] == "query"}
    assert query == {v1.MODEL, v1.OUTPUT}  # what handle_encode reads of the query, by the codec's names


def _v1_outputs(x: np.ndarray) -> dict[str, np.ndarray]:
    """One of each output a graph may have (model.contract.OUTPUT_NAMES) for the batch ``x``."""
    rows = x.shape[0]
    pooled = np.ascontiguousarray(x[:, 0])
    scores, sparse = np.ones((rows, 3), np.float32), np.zeros((rows, 7), np.float32)
    outputs = {ENCODED: x, POOLED: pooled, SCORES: scores, SPARSE: sparse}
    assert tuple(outputs) == OUTPUT_NAMES
    return outputs


def test_v1_answers_exactly_the_documented_fields():
    x = np.ones((2, 3, 4), np.float32)
    req = v1.EncodeRequest(x, None)
    body, _ = v1.encode(req, _v1_outputs(x), v1.JSON, "encoder")
    assert written(orjson.loads(body)) == documented(v1_schema.ANSWER)


@pytest.mark.parametrize("output", [None, *OUTPUT_NAMES])
def test_v1_answers_validate_against_the_documented_schema_whichever_output_is_asked(output):
    """An answer of every output, or of the one ``?output=`` names (a cross-encoder's scores alone carry no
    ``encoded``: schemathesis found that answer undocumented against a served cross-encoder); a model with fewer
    outputs answers a subset of these."""
    x = np.ones((2, 3, 4), np.float32)
    body, _ = v1.encode(v1.EncodeRequest(x, None), _v1_outputs(x), v1.JSON, "encoder", output)
    answer = orjson.loads(body)
    jsonschema.validate(answer, v1_schema.ANSWER)
    assert set(answer) - {"shape", "model"} == (set(OUTPUT_NAMES) if output is None else {output})
    for bare in ({}, {"shape": [1], "model": "encoder"}):  # no output at all is not an answer
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bare, v1_schema.ANSWER)


def test_v2_reads_exactly_the_documented_request_fields(reads, manifest):
    e = manifest.config.d_model
    mask = {"name": MASK, "shape": [1, 2], "datatype": "BOOL", "data": [False, False]}
    as_json = {
        "id": "1",
        "parameters": {"timeout": 5_000_000, "binary_data_output": False},
        "inputs": [{"name": EMBEDDINGS, "shape": [1, 2, e], "datatype": "FP32", "data": [0.5] * 2 * e}, mask],
        "outputs": [{"name": ENCODED, "parameters": {"binary_data": True}}],
    }
    v2.decode_infer(json.dumps(as_json).encode(), None, manifest, 10_000)
    binary = {"inputs": [{"name": EMBEDDINGS, "shape": [1, 2, e], "datatype": "FP32",
                          "parameters": {"binary_data_size": 8 * e}}]}  # fmt: skip
    header = json.dumps(binary).encode()
    v2.decode_infer(header + bytes(8 * e), str(len(header)), manifest, 10_000)
    assert reads == documented(v2_schema.REQUEST)


def test_v2_documents_the_one_header_it_reads():
    assert {v2.HEADER_LENGTH} == v2_schema.HEADERS  # read by routes.handle_infer for InferCodec


def test_v2_answers_exactly_the_documented_fields():
    x = np.ones((1, 2, 4), np.float32)
    answers = set()
    for binary in (False, True):
        req = v2.InferRequest("7", x, None, [v2.RequestedOutput(ENCODED, binary)])
        body, headers = v2.encode_infer(req, "encoder", {ENCODED: x})
        answers |= written(
            orjson.loads(body[: int(headers.get("Inference-Header-Content-Length", len(body)))])
        )
    assert answers == documented(v2_schema.ANSWER)
