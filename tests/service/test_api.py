"""The HTTP API in-process: health, /v1, and error mapping (every error is JSON {"error": ...})."""

import gzip
import json
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from addnorm.service import create_app
from addnorm.service.metrics import Metrics
from addnorm.service.settings import Settings
from tests.helpers import wait_until_ready


@pytest.fixture(scope="module")
def client(tiny_artifact: Path):
    app = create_app(Settings(artifact=tiny_artifact, max_elements=10_000, max_body_bytes=200_000))
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_until_ready(c)
        yield c


def test_ready_is_503_until_loaded_and_names_a_failed_load(tmp_path):
    app = create_app(Settings(artifact=tmp_path / "missing"))
    c = TestClient(app)  # lifespan not started: nothing loaded
    r = c.get("/health/ready")
    assert r.status_code == 503 and r.json() == {"error": "model is loading"}
    assert c.get("/health/live").status_code == 200
    assert c.get("/v2/health/ready").status_code == 503
    for probe in ("/health", "/ping"):  # text-embeddings-inference's
        r = c.get(probe)
        assert r.status_code == 503 and r.json() == {"error": "model is loading"}
    r = c.post("/v2/models/encoder/infer", content=b"{}")
    assert r.status_code == 503 and r.json() == {"error": "model is loading"}
    with TestClient(app) as c:
        deadline = time.monotonic() + 10
        while "failed" not in c.get("/health/ready").json()["error"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.post("/v1/encode", json={"embeddings": [[0.0] * 32]})
        assert r.status_code == 503 and "no manifest.json" in r.json()["error"]


def test_encode_json(client):
    x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)
    r = client.post("/v1/encode", json={"embeddings": x.tolist()})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["shape"] == [2, 5, 32] and doc["model"] == "encoder"
    assert np.isfinite(np.array(doc["encoded"])).all()
    for h in ("server-timing", "x-inference-time-ms", "x-queue-time-ms", "x-request-id"):
        assert h in r.headers


def test_encode_single_sequence_and_ragged(client):
    r = client.post("/v1/encode", json={"embeddings": [[0.1] * 32, [0.2] * 32]})
    assert r.json()["shape"] == [2, 32]
    r = client.post("/v1/encode", json={"embeddings": [[[0.1] * 32], [[0.2] * 32] * 3]})
    assert r.json()["shape"] == [[1, 32], [3, 32]]
    assert [len(s) for s in r.json()["encoded"]] == [1, 3]


def test_ragged_equals_each_sequence_alone(client):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 32)).tolist(), rng.standard_normal((4, 32)).tolist()
    both = client.post("/v1/encode", json={"embeddings": [a, b]}).json()["encoded"]
    alone = [client.post("/v1/encode", json={"embeddings": s}).json()["encoded"] for s in (a, b)]
    for got, want in zip(both, alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_binary_in_and_out(client):
    x = np.random.default_rng(2).standard_normal((1, 3, 32)).astype("<f4")
    r = client.post(
        "/v1/encode",
        content=x.tobytes(),
        headers={
            "content-type": "application/octet-stream",
            "x-shape": "1,3,32",
            "accept": "application/octet-stream",
        },
    )
    assert r.status_code == 200 and r.headers["x-shape"] == "1,3,32"
    binary = np.frombuffer(r.content, dtype="<f4").reshape(1, 3, 32)
    js = np.array(
        client.post("/v1/encode", json={"embeddings": x.tolist()}).json()["encoded"], dtype=np.float32
    )
    np.testing.assert_array_equal(binary, js)


BAD_REQUESTS = [
    (b'{"embeddings": [[1, 2]]}', 400, "d_model is 32"),
    (b'{"embeddings": [[[1, 2], [1]]]}', 400, "ragged"),
    (b'{"embeddings": [["x"]]}', 400, "only numbers"),
    (b'{"embeddings": [[NaN]]}', 400, "NaN"),
    (b'{"embeddings": [[Infinity]]}', 400, "NaN"),
    (b'{"embeddings": []}', 400, "non-empty"),
    (b'{"embeddings": [[[[1]]]]}', 400, "nesting"),
    (b'{"embedding": [[1]]}', 400, "unknown field"),
    (b'{"mask": [true]}', 400, "missing field"),
    (b"{", 400, "malformed JSON"),
    (b"", 400, "empty"),
    (orjson.dumps({"embeddings": [[[0.0] * 32] * 100] * 4}), 413, "limit"),
    (b"[" * 150_000 + b"]" * 150_000, 413, "body"),
    (b'{"embeddings": ' + b"[" * 500 + b"]" * 500 + b"}", 400, "nesting"),
    (b"[" * 5000 + b"]" * 5000, 400, "malformed JSON"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_a_4xx_json_error(client, body, status, message):
    r = client.post("/v1/encode", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}
    import re

    assert re.search(message, r.json()["error"]), r.json()
    assert client.get("/health/ready").status_code == 200  # still up


def test_routing_errors_are_json(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = client.get("/v1/encode")
    assert r.status_code == 405 and "error" in r.json()
    r = client.post("/v1/encode", content=b"x", headers={"content-type": "text/csv"})
    assert r.status_code == 415 and "Content-Type" in r.json()["error"]
    r = client.post("/v1/encode", json={"embeddings": [[0.0] * 32]}, headers={"accept": "text/html"})
    assert r.status_code == 406


def test_model_and_metrics(client):
    assert client.post("/v1/encode", json={"embeddings": [[0.0] * 32]}).status_code == 200
    doc = client.get("/v1/model").json()
    assert doc["name"] == "encoder" and doc["providers"] == ["CPUExecutionProvider"]
    assert doc["config"]["d_model"] == 32 and doc["parity"]["passed"]
    text = client.get("/metrics").text
    assert 'addnorm_requests_total{method="POST",route="/v1/encode",status="200"}' in text
    assert "addnorm_batch_size_bucket" in text and 'addnorm_queue_depth{model="encoder"} 0.0' in text


def test_padding_positions_are_counted_apart_from_requested_ones():
    """addnorm_batch_positions: a run of 3 x 10 positions whose requests asked for 1 x 10 and 2 x 4 (one of
    them with padding of its own, which counts as requested) added 12 positions of padding."""
    from addnorm.service.batching.batcher import Run

    metrics = Metrics()
    metrics.model("m", queue_depth=lambda: 0).batch_done(
        Run(rows=3, requests=2, seconds=0.01, merge_s=0.0, split_s=0.0, positions=30, requested=18)
    )
    text = metrics.render()
    assert b'addnorm_batch_positions_total{kind="requested",model="m"} 18.0' in text
    assert b'addnorm_batch_positions_total{kind="padding",model="m"} 12.0' in text


def test_queue_depth_is_read_at_each_scrape():
    depth = [0]
    metrics = Metrics()
    metrics.model("m", queue_depth=lambda: depth[0])
    depth[0] = 5
    assert b'addnorm_queue_depth{model="m"} 5.0' in metrics.render()


def test_openapi_describes_both_apis(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/encode"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/octet-stream", "application/x-npy"} <= set(body)
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]
    assert {"application/json", "application/octet-stream"} <= set(infer["requestBody"]["content"])
    assert {"400", "404", "503"} <= set(infer["responses"])
    for path in (
        "/v2",
        "/v2/health/ready",
        "/v2/models/{name}",
        "/v2/models/{name}/versions/{version}/infer",
        "/health/ready",
        "/metrics",
        "/v1/model",
    ):
        assert path in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_the_docs_oauth2_redirect_page_is_served_and_named_by_the_docs_page(client):
    """Swagger UI's OAuth2 redirect page (its "Authorize" flow returns to it): the /docs page names it, and it is
    the page Swagger UI's redirect script lives in, served from here (nothing fetched from a CDN)."""
    docs = client.get("/docs").text
    assert "/docs/oauth2-redirect" in docs
    r = client.get("/docs/oauth2-redirect")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert (
        "oauth2" in r.text.lower() and "window.opener" in r.text and "http" not in r.text.split("<script")[0]
    )


def test_openapi_is_true_to_the_server_no_422_and_examples_that_run(client):
    """Every documented error is a JSON {"error"} the server sends; the request examples run as documented."""
    spec = client.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation.get("responses", {}), (method, path)
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])
    v1 = spec["paths"]["/v1/encode"]["post"]["requestBody"]["content"]["application/json"]["example"]
    r = client.post("/v1/encode", json=v1)
    assert r.status_code == 200 and r.json()["shape"] == [2, 32], r.text
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]
    name = next(p["example"] for p in infer["parameters"] if p["name"] == "name")
    assert "version" not in {
        p["name"] for p in infer["parameters"]
    }  # no parameter the fast path would ignore
    v2 = infer["requestBody"]["content"]["application/json"]["example"]
    r = client.post(f"/v2/models/{name}/infer", json=v2)
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 2, 32], r.text


def test_openapi_and_the_codecs_cannot_drift(client):
    """The documented media types and tensor tables are the codecs' own, and each documented type is served."""
    from addnorm.model.contract import INPUT_NAMES
    from addnorm.service.protocols.v1 import codec as v1
    from addnorm.service.protocols.v2 import codec as v2

    spec = client.get("/openapi.json").json()
    encode = spec["paths"]["/v1/encode"]["post"]
    assert (
        set(encode["requestBody"]["content"]) == set(encode["responses"]["200"]["content"]) == set(v1.MEDIA)
    )
    x = np.full((1, 2, 32), 0.1, np.float32)
    bodies = {
        v1.JSON: orjson.dumps({"embeddings": x.tolist()}),
        v1.OCTET: x.tobytes(),
        v1.NPY: _npy(x),
    }
    for media in v1.MEDIA:  # every documented request type is read, every documented answer type is written
        r = client.post(
            "/v1/encode",
            content=bodies[media],
            headers={"Content-Type": media, "X-Shape": "1,2,32", "Accept": media},
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith(media), (media, r.text[:200])
    assert client.post("/v1/encode", content=b"1,2", headers={"Content-Type": "text/csv"}).status_code == 415
    tensor = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    item = tensor["properties"]["inputs"]["items"]["properties"]
    assert item["datatype"]["enum"] == sorted(v2.DTYPES) and item["name"]["enum"] == list(INPUT_NAMES)


def _npy(x: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def test_inference_routes_take_the_lean_path_and_others_do_not(client):
    """POST inference routes skip FastAPI's router; a wrong method or path still gets FastAPI's JSON errors."""
    assert client.post("/v2/models/encoder/infer/extra", content=b"{}").status_code == 404
    assert client.put("/v1/encode", content=b"{}").status_code == 405
    r = client.post(
        "/v2/models/encoder/versions/1/infer",
        json={
            "inputs": [{"name": "embeddings", "shape": [1, 1, 32], "datatype": "FP32", "data": [0.5] * 32}]
        },
    )
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 1, 32]


def test_compressed_body_cannot_expand_past_the_limit(client):
    import gzip

    bomb = gzip.compress(b"{" + b" " * 1_000_000 + b"}")  # 1 MB of JSON in about 1 KB
    assert len(bomb) < 200_000
    r = client.post("/v2/models/encoder/infer", content=bomb, headers={"content-encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]


_V1_DOC = json.dumps({"embeddings": [[0.5] * 32]}).encode()
_V2_DOC = json.dumps(
    {"inputs": [{"name": "embeddings", "shape": [1, 1, 32], "datatype": "FP32", "data": [0.5] * 32}]}
).encode()


@pytest.mark.parametrize(
    "path, doc", [("/v1/encode", _V1_DOC), ("/v2/models/encoder/infer", _V2_DOC)], ids=["v1", "v2"]
)
@pytest.mark.parametrize(
    "encoding, body, status",
    [
        ("gzip", lambda d: gzip.compress(d), 200),
        ("GZIP", lambda d: gzip.compress(d), 200),  # codings are case-insensitive (RFC 9110 8.4.1)
        ("x-gzip", lambda d: gzip.compress(d), 200),
        ("deflate", lambda d: zlib.compress(d), 200),
        ("identity", lambda d: d, 200),
        ("br", lambda d: d, 415),  # was read as plain JSON by /v1
        ("gzip, gzip", lambda d: gzip.compress(gzip.compress(d)), 415),
        ("gzip", lambda d: gzip.compress(d[:10]) + gzip.compress(d[10:]), 200),  # two members, joined
        ("gzip", lambda d: gzip.compress(d) + b"trailing junk", 400),  # was dropped silently
        ("gzip", lambda d: gzip.compress(d)[:-4], 400),
        ("deflate", lambda d: zlib.compress(d) + b"x", 400),
    ],
    ids=[
        "gzip",
        "GZIP",
        "x-gzip",
        "deflate",
        "identity",
        "br",
        "two-codings",
        "two-members",
        "junk",
        "truncated",
        "deflate-junk",
    ],
)
def test_content_encoding_is_decided_alike_on_both_protocols(client, path, doc, encoding, body, status):
    r = client.post(
        path, content=body(doc), headers={"content-encoding": encoding, "content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]


def test_numbers_and_booleans_do_not_mix(client):
    """V2 FP32 data holding true was read as 1.0; /v1 already refused it, and no longer refuses a model name
    that merely contains the word (its check counted literals in the raw body)."""
    doc = json.loads(_V2_DOC)
    doc["inputs"][0]["data"][3] = True
    r = client.post("/v2/models/encoder/infer", json=doc)
    assert r.status_code == 400 and "only numbers" in r.json()["error"]
    doc["inputs"][0]["data"] = [[[0.5] * 31 + [False]]]
    assert client.post("/v2/models/encoder/infer", json=doc).status_code == 400
    r = client.post("/v1/encode", json={"embeddings": [[0.5] * 31 + [True]]})
    assert r.status_code == 400 and "only numbers" in r.json()["error"]
    r = client.post("/v1/encode", json={"embeddings": [[0.5] * 32], "model": "untrue"})
    assert r.status_code == 404 and "untrue" in r.json()["error"]  # an unknown name, not "only numbers"


def test_json_logs_carry_the_request_id(tiny_artifact, capsys):
    import json
    import logging

    from addnorm.service import logs

    logs.flush()  # an earlier test's lines still queued (an in-process app's access lines) are not this test's
    capsys.readouterr()
    logs.configure("info", json_logs=True)
    try:
        logging.getLogger("addnorm.access").info("hello")
        token = logs.request_id.set("rid-1")
        logging.getLogger("addnorm.access").info("inside")
        logs.request_id.reset(token)
    finally:
        logs.configure("warning", json_logs=False)
    lines = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert (
        lines[-1]["message"] == "inside"
        and lines[-1]["request_id"] == "rid-1"
        and lines[-1]["level"] == "info"
    )


@pytest.mark.parametrize("json_logs", [False, True])
def test_access_lines_are_written_off_the_event_loop_with_their_request_id(
    tiny_artifact, capsys, monkeypatch, json_logs
):
    import json
    import logging

    from addnorm.service import logs

    logs.configure("info", json_logs=json_logs)
    # As served: "addnorm" records go only to the log's own writer.
    monkeypatch.setattr(logging.getLogger("addnorm"), "propagate", False)
    writers = []  # the thread that wrote each access line
    write = logs._write

    def recorded(text: str) -> None:
        if "addnorm.access" in text:
            writers.append(threading.current_thread().name)
        write(text)

    monkeypatch.setattr(logs, "_write", recorded)
    try:
        with TestClient(create_app(Settings(artifact=tiny_artifact))) as c:
            c.get("/health/live", headers={"x-request-id": "rid-7"})
            c.post("/v2/models/nope/infer", content=b"{}", headers={"x-request-id": "rid-8"})
        logs.flush()
        err = capsys.readouterr().err
    finally:
        logs.configure("warning", json_logs=False)
    lines = [line for line in err.splitlines() if "addnorm.access" in line]
    assert len(lines) == 2, err
    assert writers and set(writers) == {"addnorm-log"}, writers  # the writer thread, never the event loop
    if json_logs:
        docs = [json.loads(line) for line in lines]
        assert [(d["level"], d["request_id"]) for d in docs] == [("info", "rid-7"), ("info", "rid-8")]
        assert docs[0]["message"].startswith("GET /health/live 200 ")
        assert docs[1]["message"].startswith("POST /v2/models/nope/infer 404 ")
    else:
        assert " INFO addnorm.access [rid-7] GET /health/live 200 " in lines[0]
        assert " INFO addnorm.access [rid-8] POST /v2/models/nope/infer 404 " in lines[1]


def test_client_request_id_is_echoed(client):
    r = client.get("/health/live", headers={"x-request-id": "my-id-42"})
    assert r.headers["x-request-id"] == "my-id-42"


def test_a_row_that_is_all_padding_gets_a_finite_answer(client):
    x = np.random.default_rng(3).standard_normal((2, 4, 32)).tolist()
    mask = [[False, False, True, True], [True, True, True, True]]
    r = client.post("/v1/encode", json={"embeddings": x, "mask": mask})
    assert r.status_code == 200
    assert np.isfinite(np.array(r.json()["encoded"])).all()


def test_v2_output_the_model_does_not_have_is_a_400_that_names_it(client):
    doc = {
        "inputs": [{"name": "embeddings", "shape": [1, 1, 32], "datatype": "FP32", "data": [0.5] * 32}],
        "outputs": [{"name": "encoded"}, {"name": "add_norm_0"}],
    }
    r = client.post("/v2/models/encoder/infer", json=doc)
    assert r.status_code == 400 and "unknown output 'add_norm_0'" in r.json()["error"]
    doc["outputs"] = [{"name": "encoded"}, {"name": "encoded"}]
    r = client.post("/v2/models/encoder/infer", json=doc)
    assert r.status_code == 400 and "'encoded' is given twice" in r.json()["error"]
    doc["outputs"] = [{"name": "encoded", "parameters": {"binary_data": False}}]
    r = client.post("/v2/models/encoder/infer", json=doc)
    assert [o["name"] for o in r.json()["outputs"]] == ["encoded"]


def test_the_access_log_can_be_turned_off(tiny_artifact):
    import logging

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    logger = logging.getLogger("addnorm.access")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for access_log in (True, False):
            with TestClient(create_app(Settings(artifact=tiny_artifact, access_log=access_log))) as c:
                c.get("/health/live")
        assert handler.lines == [line for line in handler.lines if "GET /health/live 200" in line]
        assert len(handler.lines) == 1  # the first app logged its request, the second did not
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
