"""Shared fixtures: a tiny model exported once per session, and a real uvicorn server on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from model.config import EncoderConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0)
SMALL = EncoderConfig(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0)


def export_to(out: Path, config: EncoderConfig, **kwargs) -> Path:
    from export.pipeline import export_artifact, prepare_encoder

    export_artifact(
        prepare_encoder(config, kwargs.pop("checkpoint", None), seed=kwargs.pop("seed", 0)), out, **kwargs
    )
    return out


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer post-norm artifact (d_model 32), exported and parity-gated once."""
    return export_to(tmp_path_factory.mktemp("tiny") / "artifact", TINY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base} not ready after {timeout} s")


def start_server(
    model_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--model-dir", str(model_dir), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def server(tiny_artifact: Path) -> Iterator[str]:
    """A real uvicorn process serving the tiny artifact; yields its base URL."""
    proc, base = start_server(tiny_artifact, "--max-queue-delay-ms", "1")
    try:
        wait_ready(base, proc)
        yield base
    finally:
        stop_server(proc)
