"""A light HTTP/1.1 keep-alive load generator on asyncio streams: prebuilt request bytes, no parsing of bodies.

Light on purpose: on a 2-core machine the client shares cores with the server, so it does the least work a
client can (one write, read headers, read Content-Length bytes) and reports the CPU time it used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import numpy as np


def build_request(
    host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class LoadResult:
    requests: int
    seconds: float
    latencies_ms: np.ndarray
    client_cpu_s: float
    errors: int
    bodies: list[bytes] = field(default_factory=list)  # the first ``keep`` answers' bodies (run_load)

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if len(self.latencies_ms) else float("nan")

    def row(self) -> dict:
        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 3),
            "throughput_rps": self.throughput,
            "p50_ms": self.pct(50),
            "p99_ms": self.pct(99),
            "errors": self.errors,
            "client_cpu_s_per_request": self.client_cpu_s / max(self.requests, 1),
        }


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return status, await reader.readexactly(length)


Send = Callable[[], Awaitable[bool]]  # one request; True when it was answered with success
Connect = Callable[[], AbstractAsyncContextManager[Send]]  # one client's connection, yielding its send()


def run_load(
    host: str,
    port: int,
    request: bytes,
    concurrency: int,
    seconds: float,
    max_requests: int = 10**9,
    warmup: int = 2,
    keep: int = 0,
) -> LoadResult:
    """``concurrency`` closed-loop keep-alive HTTP clients for ``seconds`` (or ``max_requests`` in all); the bodies
    of the first ``keep`` answers (warm-up included) are kept in the result, to check what was answered."""
    kept: list[bytes] = []

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        reader, writer = await asyncio.open_connection(host, port)

        async def send() -> bool:
            writer.write(request)
            status, body = await _read_response(reader)
            if len(kept) < keep:
                kept.append(body)
            return status == 200

        try:
            yield send
        finally:
            writer.close()

    result = run_clients(connect, concurrency, seconds, max_requests, warmup)
    result.bodies = kept
    return result


def run_loads(host: str, loads: list[tuple[int, bytes, int]], seconds: float) -> list[LoadResult]:
    """Several loads at once, each ``(port, request, clients)`` run_load in its own thread; results in order."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(loads))) as pool:
        return list(pool.map(lambda load: run_load(host, *load, seconds), loads))


def run_clients(
    connect: Connect, concurrency: int, seconds: float, max_requests: int = 10**9, warmup: int = 2
) -> LoadResult:
    """``concurrency`` closed-loop clients, each on its own connection from ``connect``, for ``seconds`` (or
    ``max_requests`` in all), after a warm-up of ``warmup`` requests on up to 4 connections (first requests pay
    for allocations and thread start-up); the protocol lives in ``connect`` (HTTP above, gRPC in grpc_load).

    The clock (and the client's CPU) starts once every client's connection is open: opening them is not what is
    measured, and a short window on a busy machine had ended before a client got to send at all (0 requests)."""

    async def client(window: _Window, limit: int, lat: list, errs: list, counter: list) -> None:
        async with connect() as send:
            await window.opened()
            while time.perf_counter() < window.deadline and counter[0] < limit:
                counter[0] += 1
                t = time.perf_counter()
                ok = await send()
                lat.append((time.perf_counter() - t) * 1e3)
                if not ok:
                    errs.append(1)

    async def main() -> LoadResult:
        warm = _Window(min(concurrency, 4), 30.0)
        await asyncio.gather(*(client(warm, warmup, [], [], [0]) for _ in range(warm.clients)))
        lat: list[float] = []
        errs: list[int] = []
        window, counter = _Window(concurrency, seconds), [0]
        await asyncio.gather(*(client(window, max_requests, lat, errs, counter) for _ in range(concurrency)))
        elapsed = time.perf_counter() - window.start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime - window.cpu.ru_utime) + (cpu1.ru_stime - window.cpu.ru_stime)
        return LoadResult(len(lat), elapsed, np.array(lat), cpu, len(errs))

    return asyncio.run(main())


class _Window:
    """A load's measured window: it opens when the last of its ``clients`` connections has, and lasts ``seconds``."""

    def __init__(self, clients: int, seconds: float) -> None:
        self.clients, self.seconds = clients, seconds
        self.connected = 0
        self.go = asyncio.Event()
        self.start = self.deadline = 0.0
        self.cpu: resource.struct_rusage | None = None  # the client's CPU when it opened

    async def opened(self) -> None:
        """A client's connection is open: wait until every client's is (the last one starts the clock)."""
        self.connected += 1
        if self.connected == self.clients:
            self.cpu = resource.getrusage(resource.RUSAGE_SELF)
            self.start = time.perf_counter()
            self.deadline = self.start + self.seconds
            self.go.set()
        await self.go.wait()
