"""The HTTP front's direct lane: the inference routes (marked ``protocols.common.direct``) are called by the front
itself, without FastAPI's router and dependency solving; they must answer exactly as FastAPI's routing would."""

from __future__ import annotations

import re

import numpy as np
import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from starlette.routing import Match

from addnorm.service import create_app
from addnorm.service.core import inference
from addnorm.service.front.middleware import Front
from addnorm.service.settings import Settings
from tests.helpers import error_message, wait_until_ready
from tests.service.test_guard import PARAMS

DIRECT = {
    ("POST", "/v1/encode"),
    ("POST", "/v1/embeddings"),
    ("POST", "/embed"),
    ("POST", "/v2/models/encoder/infer"),
    ("POST", "/v2/models/encoder/versions/1/infer"),
}
HEADERS_COMPARED = ("content-type", "retry-after", "www-authenticate")


@pytest.fixture(scope="module")
def loaded(tiny_artifact):
    app = create_app(Settings(artifact=tiny_artifact, grpc_port=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until_ready(client)
        yield app, client


def _front(app) -> Front:
    assert isinstance(app.front, Front)
    return app.front


def _requests() -> list[tuple[str, str, dict]]:
    tensor = {
        "name": "embeddings",
        "shape": [1, 3, 32],
        "datatype": "FP32",
        "data": np.linspace(-1, 1, 96).tolist(),
    }
    return [
        ("POST", "/v1/encode", {"json": {"embeddings": np.ones((1, 3, 32)).tolist()}}),
        ("POST", "/v1/encode", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("POST", "/v1/encode", {"content": b"\x00" * 12, "headers": {"content-type": "text/plain"}}),
        ("POST", "/v2/models/encoder/infer", {"json": {"inputs": [tensor]}}),
        ("POST", "/v2/models/encoder/versions/1/infer", {"json": {"inputs": [tensor]}}),
        ("POST", "/v2/models/encoder/versions/7/infer", {"json": {"inputs": [tensor]}}),
        ("POST", "/v2/models/nobody/infer", {"json": {"inputs": [tensor]}}),
        ("POST", "/v2/models/encoder/infer", {"json": {"inputs": []}}),
        ("POST", "/v1/embeddings", {"json": {"input": "a sentence"}}),  # a model of embeddings: a 400
        ("POST", "/v1/embeddings", {"content": b"[", "headers": {"content-type": "application/json"}}),
        ("POST", "/embed", {"json": {"inputs": 3}}),
    ]


def _answer(r) -> tuple:
    return r.status_code, r.content, tuple(r.headers.get(h) for h in HEADERS_COMPARED)


def test_the_direct_routes_are_the_inference_routes(loaded):
    app, _ = loaded
    front = _front(app)
    for method, path in DIRECT:
        assert front._lane({"method": method, "path": path, "root_path": ""}) is not None, (method, path)
    for method, path in [("GET", "/v1/models"), ("GET", "/v2/models/encoder"), ("GET", "/v1/encode")]:
        assert front._lane({"method": method, "path": path}) is None, (method, path)
    # mounted under a prefix (a proxy's root_path): FastAPI's router, which strips it, routes the request
    assert front._lane({"method": "POST", "path": "/api/v1/encode", "root_path": "/api"}) is None


def test_each_direct_route_is_the_one_fastapis_router_picks_for_its_path(loaded):
    """No route declared before a direct one matches its paths: the lane never takes a request FastAPI would give
    another route."""
    app, _ = loaded
    front = _front(app)
    front._lane({"method": "POST", "path": "/", "root_path": ""})  # the lanes read
    assert len(front._lanes) >= len(DIRECT)
    for *_, route in front._lanes:
        path = re.sub(r"{(\w+)}", lambda m: PARAMS[m[1]], route.path)
        for method in route.methods:
            scope = {"type": "http", "method": method, "path": path, "root_path": ""}
            first = next(
                r for r in iter_route_contexts(app.router.routes) if r.matches(scope)[0] is not Match.NONE
            )
            assert first.endpoint is route.endpoint, (method, path, first)


def test_the_direct_lane_answers_as_fastapis_routing_does(loaded, monkeypatch):
    """The same requests through the lane and through FastAPI's router (the lane turned off): same status, body
    and headers; the errors in their API's shape."""
    app, client = loaded
    lane = [_answer(client.request(m, p, **kw)) for m, p, kw in _requests()]
    monkeypatch.setattr(Front, "_lane", lambda self, scope: None)
    routed = [_answer(client.request(m, p, **kw)) for m, p, kw in _requests()]
    assert lane == routed
    assert sorted({status for status, *_ in lane}) == [200, 400, 404]


def test_an_unexpected_error_in_a_direct_route_is_a_500_in_its_shape_and_the_server_stays_up(
    loaded, monkeypatch
):
    app, client = loaded

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(inference, "run", broken)
    for path in ("/v1/embeddings", "/v2/models/encoder/infer"):
        r = client.post(path, json={"input": "x"} if path.startswith("/v1") else {"inputs": []})
        assert r.status_code == 500 and "internal" in error_message(r).lower(), (path, r.text)
    monkeypatch.undo()
    assert client.post("/v1/encode", json={"embeddings": np.ones((1, 3, 32)).tolist()}).status_code == 200


def test_metrics_label_a_direct_request_by_its_route(loaded):
    app, client = loaded
    assert client.post("/v2/models/encoder/infer", json={"inputs": []}).status_code == 400
    metrics = client.get("/metrics").text
    assert re.search(r'route="/v2/models/\{name\}/infer"', metrics), metrics[:2000]


def test_the_front_sees_every_answer_fastapis_own_500_included(loaded):
    """The app calls the front first, outside FastAPI's own middleware: an unexpected error in a route FastAPI routes
    is answered by FastAPI's error middleware inside it, with the request's id and counted by its status."""
    app, client = loaded

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/v1/broken-for-a-test", broken)
    try:
        r = client.get("/v1/broken-for-a-test", headers={"x-request-id": "front-500"})
    finally:
        app.router.routes.pop()
    assert r.status_code == 500 and "internal" in error_message(r).lower(), r.text
    assert r.headers["x-request-id"] == "front-500"
    metrics = client.get("/metrics").text
    assert re.search(r'route="/v1/broken-for-a-test"[^\n]*status="500"', metrics) or re.search(
        r'status="500"[^\n]*route="/v1/broken-for-a-test"', metrics
    ), metrics[:2000]


def test_answers_carry_no_request_id_where_a_proxy_adds_its_own(tiny_artifact):
    """``answer_request_id=False`` (Ray Serve's replica: its proxy adds the id to each answer): the answers, direct
    lane's and FastAPI's, carry none of their own."""
    app = create_app(Settings(artifact=tiny_artifact, grpc_port=0), answer_request_id=False)
    with TestClient(app) as client:
        wait_until_ready(client)
        for r in (
            client.post("/v1/encode", json={"embeddings": np.ones((1, 3, 32)).tolist()}),
            client.get("/v1/models"),
        ):
            assert r.status_code == 200 and "x-request-id" not in r.headers, r.headers
