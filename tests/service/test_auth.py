"""API keys: every route but the health probes needs one when keys are set; keys never leak."""

import logging

import pytest
from fastapi.testclient import TestClient

from addnorm.service import cli, create_app, logs
from addnorm.service.settings import Settings
from bench.server import free_port
from tests.helpers import error_message, wait_until_ready
from tests.service.test_guard import served_routes

PROBES = {"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready", "/health", "/ping"}
KEYS = ("key-one-7f3a", "key-two-91bc", "key-file-55de")


@pytest.fixture(scope="module")
def secured(tiny_artifact, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api_keys"
    key_file.write_text(f"# one key a line\n{KEYS[2]}\n\n")
    settings = Settings(artifact=tiny_artifact, api_key=f"{KEYS[0]}, {KEYS[1]}", api_key_file=key_file)
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until_ready(client)
        yield app, client


def test_every_route_but_the_probes_needs_a_key(secured, caplog):
    app, client = secured
    caplog.set_level(logging.DEBUG)
    for method, path in served_routes(app):
        for headers in ({}, {"authorization": "Bearer wrong-key"}, {"authorization": f"Basic {KEYS[0]}"}):
            r = client.request(method, path, content=b"{}", headers=headers)
            if path in PROBES:
                assert r.status_code != 401, (method, path)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"].startswith("Bearer") and error_message(r)
        if path not in PROBES:
            r = client.request(method, path, content=b"{}", headers={"authorization": f"Bearer {KEYS[1]}"})
            assert r.status_code != 401, (method, path)
    text = caplog.text + client.get("/v1/model", headers={"authorization": f"Bearer {KEYS[0]}"}).text
    assert not any(key in text for key in KEYS)  # never logged, never echoed


def test_each_key_works_for_inference(secured):
    _, client = secured
    body = {"embeddings": [[0.5] * 32]}
    for key in KEYS:
        r = client.post("/v1/encode", json=body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    r = client.post("/v1/encode", json=body)
    assert r.status_code == 401 and r.json() == {
        "error": "this server needs an API key: send 'Authorization: Bearer <key>'"
    }
    r = client.post("/v1/encode", json=body, headers={"authorization": "Bearer nope"})
    assert r.json() == {"error": "invalid API key"}


def test_metrics_can_be_made_public(tiny_artifact):
    app = create_app(Settings(artifact=tiny_artifact, api_key="k", metrics_public=True))
    client = TestClient(app)
    assert client.get("/metrics").status_code == 200
    assert client.get("/v2").status_code == 401


def test_unreadable_or_empty_key_file_refuses_to_start(tiny_artifact, tmp_path, capsys):
    assert cli.main(["--artifact", str(tiny_artifact), "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    (tmp_path / "empty").write_text("# nothing\n\n")
    assert cli.main(["--artifact", str(tiny_artifact), "--api-key-file", str(tmp_path / "empty")]) == 2
    assert "holds no key" in capsys.readouterr().err


def test_start_up_warns_loudly_without_a_key_off_loopback(tiny_artifact, monkeypatch, capsys):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)  # stop short of binding (--workers > 1)
    monkeypatch.setattr(cli, "_run", lambda *a, **kw: True)  # and one process's server

    def stderr_of(*args: str) -> str:  # on a free port: the check that it can be bound runs first
        ports = ["--port", str(free_port()), "--grpc-port", "0"]
        assert cli.main(["--artifact", str(tiny_artifact), *ports, *args]) == 0
        logs.flush()  # the listener thread writes log lines on its own time
        return capsys.readouterr().err

    assert "WITHOUT AN API KEY" in stderr_of("--host", "0.0.0.0", "--log-level", "warning")
    assert "WITHOUT AN API KEY" not in stderr_of("--host", "127.0.0.1", "--log-level", "warning")
    assert "WITHOUT AN API KEY" not in stderr_of("--host", "0.0.0.0", "--api-key", "k")
    assert cli.is_loopback("::1") and cli.is_loopback("localhost") and not cli.is_loopback("example.org")
