"""The one request guard: every route the app serves goes through it, the fast path's included."""

import re

import pytest
from fastapi.testclient import TestClient

from service import create_app
from service.errors import ServiceError
from service.guard import Guard
from service.protocols import PUBLIC_PATHS
from service.settings import Settings

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
    app = create_app(Settings(model_dir=tiny_artifact))
    with TestClient(app, raise_server_exceptions=False) as client:
        while client.get("/health/ready").status_code != 200:
            pass
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

    def refuse(self, scope):
        raise Refused(f"refused by the guard: {scope['path']}")

    monkeypatch.setattr(Guard, "check", refuse)
    for method, path in served_routes(app):
        r = client.request(method, path, content=b"{}")
        assert r.json() == {"error": f"refused by the guard: {path}"}, (method, path, r.status_code)
    monkeypatch.undo()
    assert client.post("/v1/encode", json={"embeddings": [[0.0] * 32]}).status_code == 200


def test_before_the_model_loads_model_routes_get_503_and_nothing_500s(tmp_path):
    """Readiness is the guard's: a model route it did not cover would reach its handler and answer 500."""
    app = create_app(Settings(model_dir=tmp_path / "missing"))
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: nothing loads
    seen = {}
    for method, path in served_routes(app):
        r = client.request(method, path, content=b"{}")
        seen[(method, path)] = r.status_code
        assert r.status_code < 500 or r.json() == {"error": "model is loading"}, (method, path, r.text)
    assert seen[("POST", "/v1/encode")] == seen[("POST", "/v2/models/encoder/infer")] == 503
    assert seen[("GET", "/v1/model")] == seen[("GET", "/v2/models/encoder")] == 503
    assert seen[("GET", "/health/live")] == seen[("GET", "/v2/health/live")] == 200
    assert {path for (_, path), status in seen.items() if status == 200} >= {"/metrics", "/docs", "/v2"}
    assert {"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"} == PUBLIC_PATHS
