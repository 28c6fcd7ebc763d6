"""The one request guard: every route the app serves goes through it, the fast path's included."""

import re

import grpc
import pytest
from fastapi.testclient import TestClient

from addnorm.service import create_app
from addnorm.service.errors import ServiceError
from addnorm.service.guard import Guard
from addnorm.service.protocols import PUBLIC_PATHS
from addnorm.service.protocols.v2 import grpc_server
from addnorm.service.settings import Settings
from tests.helpers import error_message, wait_until_ready

PARAMS = {"name": "encoder", "version": "1"}


def served_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""
    found: list[tuple[str, str]] = []

    def walk(routes) -> None:
        for route in routes:
            if hasattr(route, "original_router"):  # an included router (FastAPI keeps it whole)
                walk(route.original_router.routes)
                continue
            path = re.sub(r"{(\w+)}", lambda m: PARAMS[m[1]], route.path)
            found.extend((method, path) for method in sorted(route.methods - {"HEAD"}))

    walk(app.routes)
    return found


class Refused(ServiceError):
    """What the test's guard raises; mapped to 500 (not in the table), a code no route answers by itself."""


@pytest.fixture(scope="module")
def loaded_app(tiny_artifact):
    app = create_app(Settings(artifact=tiny_artifact))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until_ready(client)
        yield app, client


def test_every_route_is_enumerated(loaded_app):
    app, _ = loaded_app
    routes = served_routes(app)
    for expected in (
        ("POST", "/v1/encode"),
        ("POST", "/v2/models/encoder/infer"),
        ("GET", "/metrics"),
        ("GET", "/health/live"),
        ("GET", "/docs"),
        ("GET", "/v2/models/encoder/versions/1/ready"),
    ):
        assert expected in routes
    assert len(routes) >= 17


def test_a_failing_guard_stops_every_route(loaded_app, monkeypatch):
    app, client = loaded_app

    def refuse(self, path, credentials):
        raise Refused(f"refused by the guard: {path}")

    monkeypatch.setattr(Guard, "check", refuse)
    for method, path in served_routes(app):
        r = client.request(method, path, content=b"{}")
        assert error_message(r) == f"refused by the guard: {path}", (method, path, r.status_code)
    monkeypatch.undo()
    assert client.post("/v1/encode", json={"embeddings": [[0.0] * 32]}).status_code == 200


def test_before_the_model_loads_model_routes_get_503_and_nothing_500s(tmp_path):
    """Readiness is the guard's: a model route it did not cover would reach its handler and answer 500."""
    app = create_app(Settings(artifact=tmp_path / "missing"))
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: nothing loads
    seen = {}
    for method, path in served_routes(app):
        r = client.request(method, path, content=b"{}")
        seen[(method, path)] = r.status_code
        assert r.status_code < 500 or error_message(r) == "model is loading", (method, path, r.text)
    assert seen[("POST", "/v1/encode")] == seen[("POST", "/v2/models/encoder/infer")] == 503
    assert seen[("GET", "/v1/model")] == seen[("GET", "/v2/models/encoder")] == 503
    assert seen[("GET", "/health/live")] == seen[("GET", "/v2/health/live")] == 200
    assert {path for (_, path), status in seen.items() if status == 200} >= {"/metrics", "/docs", "/v2"}
    assert {"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready", "/health", "/ping"} | set(
        grpc_server.PUBLIC_PATHS
    ) == PUBLIC_PATHS


@pytest.fixture(scope="module")
def grpc_app(tiny_artifact):
    """The app with its gRPC service on a free port, in this process (so the guard can be swapped)."""
    from bench.server import free_port

    port = free_port()
    app = create_app(Settings(artifact=tiny_artifact, grpc_port=port, api_key="k1,k2"))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until_ready(client)
        yield client, f"127.0.0.1:{port}"


def _call(target: str, method: str, metadata=()) -> grpc.RpcError | bytes:
    """One raw call (an empty message: every request type parses from zero bytes)."""
    with grpc.insecure_channel(target) as channel:
        rpc = channel.unary_unary(f"/{grpc_server.SERVICE}/{method}")
        try:
            return rpc(b"", metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc


def test_a_failing_guard_stops_every_grpc_method(grpc_app, monkeypatch):
    """The gRPC twin of the route walk: every method the service has, and one it has not, meets the guard first."""
    _, target = grpc_app

    def refuse(self, path, credentials):
        raise Refused(f"refused by the guard: {path}")

    monkeypatch.setattr(Guard, "check", refuse)
    for method in [*grpc_server._METHODS, "ModelStreamInfer", "RepositoryModelLoad"]:
        got = _call(target, method, metadata=[("authorization", "Bearer k1")])
        assert isinstance(got, grpc.RpcError), method
        assert (
            got.code() == grpc.StatusCode.INTERNAL
            and got.details() == f"refused by the guard: /{grpc_server.SERVICE}/{method}"
        )
    monkeypatch.undo()
    assert isinstance(_call(target, "ServerMetadata", metadata=[("authorization", "Bearer k1")]), bytes)


def test_keys_and_duplicate_credentials_are_decided_alike_on_both_transports(grpc_app):
    client, target = grpc_app
    cases = {
        "none": ([], 401, grpc.StatusCode.UNAUTHENTICATED),
        "right": ([("authorization", "Bearer k2")], 200, None),
        "wrong": ([("authorization", "Bearer nope")], 401, grpc.StatusCode.UNAUTHENTICATED),
        "two, one right": (
            [("authorization", "Bearer nope"), ("authorization", "Bearer k1")],
            401,
            grpc.StatusCode.UNAUTHENTICATED,
        ),
        "the right one twice": (
            [("authorization", "Bearer k1"), ("authorization", "Bearer k1")],
            401,
            grpc.StatusCode.UNAUTHENTICATED,
        ),
    }
    for name, (headers, status, code) in cases.items():
        r = client.get("/v2", headers=headers)
        assert r.status_code == status, (name, r.text)
        got = _call(target, "ServerMetadata", metadata=headers)
        if code is None:
            assert isinstance(got, bytes), name
        else:
            assert got.code() == code, name
            assert got.details() == r.json()["error"], name  # the same words on both
    # the probes stay open on both
    assert client.get("/v2/health/live").status_code == 200
    assert isinstance(_call(target, "ServerLive"), bytes)


def test_a_malformed_grpc_message_is_invalid_argument_after_the_guard(grpc_app):
    """Bytes that are not the method's message are parsed in the handler: refused without a key first, then
    INVALID_ARGUMENT naming the message, never UNKNOWN (issue 24)."""
    _, target = grpc_app
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length prefix far past the end
    with grpc.insecure_channel(target) as channel:
        infer = channel.unary_unary(f"/{grpc_server.SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            infer(garbage, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the guard first
        with pytest.raises(grpc.RpcError) as info:
            infer(garbage, metadata=[("authorization", "Bearer k1")], timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest message" in info.value.details()


def test_a_call_without_a_request_message_is_answered_not_left_to_its_deadline(grpc_app):
    """A unary call whose client half-closes before sending its message: INVALID_ARGUMENT naming what is
    missing, for every method (grpc.aio's unary handler would wait for the client's deadline; issue 24)."""
    _, target = grpc_app
    key = [("authorization", "Bearer k1")]
    with grpc.insecure_channel(target) as channel:
        for method in grpc_server._METHODS:
            call = channel.stream_unary(f"/{grpc_server.SERVICE}/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(iter(()), metadata=key, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
            assert "ended without a request message" in info.value.details()
        # refused by the guard without a message: refused, not left waiting either
        with pytest.raises(grpc.RpcError) as info:
            channel.stream_unary(f"/{grpc_server.SERVICE}/ModelInfer")(iter(()), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
