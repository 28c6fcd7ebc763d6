"""Helpers the tests share (not fixtures: conftest.py has those)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition`` every 20 ms until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)


def wait_until_ready(client, path: str = "/health/ready", timeout: float = 60.0) -> None:
    """Until ``client`` (a TestClient or an httpx client) gets 200 from ``path``; bounded by ``timeout``."""
    wait_until(lambda: client.get(path).status_code == 200, timeout, f"GET {path} answering 200")
