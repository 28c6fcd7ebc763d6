"""Helpers the tests share (not fixtures: conftest.py has those)."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.server import ROOT


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition`` every 20 ms until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)


def queue_depth(base: str, model: str = "encoder") -> int:
    """A served model's requests waiting for a run, from the server's /metrics (addnorm_queue_depth)."""
    import httpx

    want = f'addnorm_queue_depth{{model="{model}"}}'
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    return int(float(next(ln.split()[-1] for ln in metrics.splitlines() if ln.startswith(want))))


def wait_until_ready(client, path: str = "/health/ready", timeout: float = 60.0) -> None:
    """Until ``client`` (a TestClient or an httpx client) gets 200 from ``path``; bounded by ``timeout``."""
    wait_until(lambda: client.get(path).status_code == 200, timeout, f"GET {path} answering 200")


def skew_gamma(source: Path, art: Path) -> Path:
    """A copy of the artifact ``source`` at ``art`` whose first LayerNorm gamma is 1.05 times the exported one,
    its manifest re-hashed: it loads (with verify-on-load warn) and answers wrongly by a few percent."""
    import json
    import shutil

    import onnx
    from onnx import numpy_helper

    from addnorm.model.artifact import MANIFEST_FILE, sha256_file

    shutil.copytree(source, art)
    model = onnx.load(str(art / "model.onnx"))
    norm = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    init = next(i for i in model.graph.initializer if i.name == norm.input[1])
    gamma = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((gamma * 1.05).astype(gamma.dtype), init.name))
    onnx.save(model, str(art / "model.onnx"))
    doc = json.loads((art / MANIFEST_FILE).read_text())
    doc["model_sha256"] = sha256_file(art / "model.onnx")
    (art / MANIFEST_FILE).write_text(json.dumps(doc))
    return art


def raw_http(port: int, pieces: list[bytes], timeout: float = 30.0) -> tuple[int, bytes]:
    """Send ``pieces`` on a new loopback connection, one write each (TCP_NODELAY: each its own segment), and read
    until the server closes it (the request should say ``Connection: close``): (status, body) of the first answer."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces:
            s.sendall(piece)
        raw = b""
        deadline = time.monotonic() + timeout
        while chunk := s.recv(65536):
            raw += chunk
            assert time.monotonic() < deadline, raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), raw[:300]
    return int(head.split(b" ")[1]), body


@contextlib.contextmanager
def front_proxy(upstream_port: int, **settings: object) -> Iterator[int]:
    """nginx on a free loopback port in front of ``127.0.0.1:upstream_port``, configured as deploy/nginx is
    (service.front.nginx_conf.render) from ``Settings(**settings)``; yields its port. Skips where nginx is not installed
    (Debian's nginx; .ci/run installs it, and in CI the skip fails)."""
    import pytest

    from addnorm.service.front.nginx_conf import render
    from addnorm.service.settings import Settings
    from bench.server import free_port

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is not installed (apt-get install nginx)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="addnorm-nginx-") as prefix:
        # As root, nginx's workers run as nobody: they must reach the temporary paths under the prefix (a body too
        # big for memory is written there; the directory is created 0700).
        Path(prefix).chmod(0o755)
        conf = Path(prefix) / "nginx.conf"
        conf.write_text(
            render(Settings(**settings), f"127.0.0.1:{port}", f"127.0.0.1:{upstream_port}", prefix)
        )
        log = open(Path(prefix) / "stderr", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [nginx, "-p", prefix, "-c", str(conf), "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT
        )
        try:

            def listening() -> bool:
                assert proc.poll() is None, (Path(prefix) / "stderr").read_text()
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
                return False

            wait_until(listening, 30, "nginx listening")
            yield port
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def error_message(r) -> str:
    """The message of an HTTP error answer (an httpx response), after checking its body is in the shape of the API
    its path belongs to: OpenAI's error object (vLLM's too), text-embeddings-inference's {error, error_type},
    Cohere's {message}, else {error}."""
    doc = r.json()
    path = r.request.url.path
    openai = (
        "/v1/embeddings",
        "/v1/models",
        "/embeddings",
        "/models",
        "/score",
        "/classify",
        "/v1/score",
        "/v1/classify",
        "/detokenize",
        "/pooling",
    )
    if path.startswith(openai):
        error = doc["error"]
        assert set(doc) == {"error"} and set(error) == {"message", "type", "param", "code"}, doc
        return error["message"]
    if path.startswith(("/embed", "/similarity", "/tokenize", "/decode", "/rerank", "/predict", "/info")):
        assert set(doc) == {"error", "error_type"} and isinstance(doc["error"], str), doc
        return doc["error"]
    if path.startswith(("/v1/rerank", "/v2/rerank", "/v1/embed", "/v2/embed")):  # Cohere's
        assert set(doc) == {"message"} and isinstance(doc["message"], str), doc
        return doc["message"]
    assert set(doc) == {"error"} and isinstance(doc["error"], str), doc
    return doc["error"]


# schemathesis's checks: every answer as the served OpenAPI document says (tests/test_schemathesis.py)
CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",  # found /v1/model's 404 and V2 infer's 408 undocumented
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
    )
)
SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))


def run_schemathesis(
    base: str, model: str, tmp_path: Path, examples: int = 20, least: int = 300, options: tuple[str, ...] = ()
) -> str:
    """schemathesis against ``base``'s /openapi.json, its path parameters naming ``model`` (``options``: more of
    its command line, a filter of operations say): every check passes, and at least ``least`` requests were
    generated; its report."""
    config = tmp_path / "schemathesis.toml"
    # the path parameters reach the real model
    config.write_text(f'[parameters]\n"path.name" = "{model}"\n"path.version" = "1"\n')
    cmd = [SCHEMATHESIS, "--config-file", str(config), "run", f"{base}/openapi.json",
           "--checks", CHECKS, "--max-examples", str(examples), "--seed", "1", "--no-color", *options]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    generated = int(re.search(r"(\d+) generated", r.stdout)[1])
    assert generated >= least and re.search(rf"{generated} passed", r.stdout), r.stdout[-2000:]
    return r.stdout
