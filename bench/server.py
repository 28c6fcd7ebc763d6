"""A server subprocess on a free loopback port, for benchmarks and tests alike."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: their sockets are all bound at once before any closes, so the OS cannot hand the
    same port out twice (two ``free_port()`` calls in a row can, and did: a server's HTTP and gRPC on one port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]


class ServerProcess:
    """``python ARGS --port P`` in the repo root, on a free port; ``wait()`` until ``ready_path`` answers 200.
    ``grpc=True`` gives it a free gRPC port too (``grpc_port``); otherwise its gRPC service is off.

    A context manager: ``with ServerProcess([...]) as srv: ...`` starts, waits, and stops it.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        ready_path: str = "/health/ready",
        capture: bool = True,
        grpc: bool = False,
        python: str = sys.executable,
    ) -> None:
        self.port, self.grpc_port = free_ports(2) if grpc else (free_port(), 0)
        self.base = f"http://{HOST}:{self.port}"
        env = {"ADDNORM_GRPC_PORT": str(self.grpc_port), **(env or {})}
        self.ready_path = ready_path
        # The server's output goes to a file, never to a pipe nobody reads: a full pipe would block its logging.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [python, *args, "--port", str(self.port)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log if capture else subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )

    def output(self) -> str:
        """What the server has printed so far."""
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout: float = 120.0) -> ServerProcess:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + self.ready_path, timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.base} not ready after {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self) -> ServerProcess:
        try:
            return self.wait()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    artifact: Path, *flags: str, grpc: bool = False, env: dict[str, str] | None = None
) -> ServerProcess:
    """addnorm-serve on ``artifact`` as a user runs it (log level info, an access line per request: the log goes to
    a temporary file), not yet waited for; ``grpc``: with gRPC on a free port too; ``env``: ADDNORM_* settings."""
    return ServerProcess(
        ["-m", "addnorm.service", "--artifact", str(artifact), *flags],
        env=env,
        capture=False,
        grpc=grpc,
    )
