"""Soak and burst: the service under a mixed, hostile load, and its memory around a burst of maximum-size requests.

``soak``: keep-alive clients mixing valid /v1 and /v2 requests (JSON and binary, ragged, masked), invalid ones,
oversized ones, and clients that hang up mid-request. Every answer to a valid request is checked against
in-process onnxruntime. Reports per-status counts, latency, and the server's resident memory and open file
descriptors at the start and the end. ``burst``: resident memory before, at the peak of, and after N concurrent
maximum-size requests. Both talk only to a server they start on 127.0.0.1, and stop by themselves.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from addnorm.model.artifact import Manifest
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
from addnorm.model.packing import answered
from bench.loadgen import build_request
from bench.server import HOST, serve

ATOL, RTOL = 1e-4, 1e-3  # batching pads and merges: equal to an unbatched run within float32 reordering


@dataclass
class Probe:
    """One prepared request: its bytes, and what a correct answer is (``expected``), or which statuses are right."""

    kind: str
    request: bytes
    expected: np.ndarray | list[np.ndarray] | None = None
    ok_statuses: tuple[int, ...] = (200,)
    hang_up: bool = False  # send half of it, then close the connection


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def proc_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _v2_binary(port: int, name: str, x: np.ndarray, mask: np.ndarray | None) -> bytes:
    inputs = [
        {
            "name": EMBEDDINGS,
            "shape": list(x.shape),
            "datatype": "FP32",
            "parameters": {"binary_data_size": x.nbytes},
        }
    ]
    blobs = [x.tobytes()]
    if mask is not None:
        inputs.append(
            {
                "name": MASK,
                "shape": list(mask.shape),
                "datatype": "BOOL",
                "parameters": {"binary_data_size": mask.nbytes},
            }
        )
        blobs.append(mask.tobytes())
    header = orjson.dumps(
        {"inputs": inputs, "outputs": [{"name": ENCODED, "parameters": {"binary_data": True}}]}
    )
    return build_request(
        HOST,
        port,
        f"/v2/models/{name}/infer",
        header + b"".join(blobs),
        {"Inference-Header-Content-Length": str(len(header))},
    )


def make_probes(
    port: int, manifest: Manifest, engine, rng: np.random.Generator, max_body: int
) -> list[Probe]:
    """A pool of valid requests with their in-process answers, and of invalid, oversized and hang-up ones."""
    e, name = manifest.config.d_model, manifest.name
    probes: list[Probe] = []
    for i in range(24):
        b, s = int(rng.integers(1, 4)), int(rng.integers(1, 24))
        x = rng.standard_normal((b, s, e)).astype(np.float32)
        mask = None
        if i % 3 == 0 and s > 1:
            mask = np.zeros((b, s), bool)
            mask[:, s - int(rng.integers(1, s)) :] = True
        want = answered(engine.run(x, mask)[ENCODED], mask)  # a row's trailing padding answers zeros
        kind = ("v1-json", "v1-binary", "v2-json", "v2-binary")[i % 4]
        if kind == "v1-json":
            doc = {EMBEDDINGS: x.tolist(), **({MASK: mask.tolist()} if mask is not None else {})}
            req = build_request(
                HOST, port, "/v1/encode", orjson.dumps(doc), {"Content-Type": "application/json"}
            )
        elif kind == "v1-binary":
            headers = {
                "Content-Type": "application/octet-stream",
                "X-Shape": ",".join(map(str, x.shape)),
                "Accept": "application/octet-stream",
            }
            if mask is not None:
                headers["X-Lengths"] = ",".join(str(int((~m).sum())) for m in mask)
                mask = np.arange(s)[None, :] >= (~mask).sum(1)[:, None]
                want = answered(engine.run(x, mask)[ENCODED], mask)
            req = build_request(HOST, port, "/v1/encode", x.tobytes(), headers)
        elif kind == "v2-json":
            inputs = [
                {"name": EMBEDDINGS, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
            ]
            if mask is not None:
                inputs.append(
                    {
                        "name": MASK,
                        "shape": list(mask.shape),
                        "datatype": "BOOL",
                        "data": mask.ravel().tolist(),
                    }
                )
            req = build_request(HOST, port, f"/v2/models/{name}/infer", orjson.dumps({"inputs": inputs}), {})
        else:
            req = _v2_binary(port, name, x, mask)
        probes.append(Probe(kind, req, want))
    seqs = [
        rng.standard_normal((int(n), e)).astype(np.float32) for n in (3, 7, 1)
    ]  # ragged: each its own length
    ragged = [engine.run(sq[None])[ENCODED][0] for sq in seqs]
    body = orjson.dumps({EMBEDDINGS: [sq.tolist() for sq in seqs]})
    probes.append(Probe("v1-ragged", build_request(HOST, port, "/v1/encode", body, {}), ragged))
    for bad in (
        b"{",
        b'{"embeddings": [[1, 2]]}',
        b'{"embeddings": "x"}',
        b"[]",
        b'{"inputs": [{"name": ["x"], "shape": [1], "datatype": "FP32", "data": [1]}]}',
    ):
        probes.append(Probe("invalid", build_request(HOST, port, "/v1/encode", bad, {}), ok_statuses=(400,)))
        path = f"/v2/models/{name}/infer"
        probes.append(Probe("invalid", build_request(HOST, port, path, bad, {}), ok_statuses=(400,)))
    big = build_request(HOST, port, "/v1/encode", b"0" * (max_body + 1), {"Content-Type": "application/json"})
    probes.append(Probe("oversized", big, ok_statuses=(413,)))
    probes.append(Probe("hang-up", probes[0].request, hang_up=True))
    return probes


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return int(lines[0].split()[1]), headers, body


def answer_is_right(probe: Probe, headers: dict[bytes, bytes], body: bytes) -> bool:
    """Decode the answer as its protocol says and compare it with the in-process run."""
    if probe.kind in ("v1-json", "v1-ragged"):
        got = orjson.loads(body)[ENCODED]
        if probe.kind == "v1-ragged":
            return all(
                np.allclose(np.array(g, np.float32), w, atol=ATOL, rtol=RTOL)
                for g, w in zip(got, probe.expected, strict=True)
            )
        got = np.array(got, np.float32)
    elif probe.kind == "v1-binary":
        got = np.frombuffer(body, "<f4").reshape(tuple(int(d) for d in headers[b"x-shape"].split(b",")))
    elif probe.kind == "v2-json":
        out = orjson.loads(body)["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
    else:
        n = int(headers[b"inference-header-content-length"])
        out = orjson.loads(body[:n])["outputs"][0]
        got = np.frombuffer(body[n:], "<f4").reshape(out["shape"])
    return got.shape == probe.expected.shape and bool(np.allclose(got, probe.expected, atol=ATOL, rtol=RTOL))


@dataclass
class SoakResult:
    seconds: float
    statuses: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    wrong_answers: int = 0
    unexpected: list[str] = field(default_factory=list)  # (kind, status) that the probe did not allow
    hang_ups: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    rss_mb: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    rss_series: list[float] = field(default_factory=list)  # MB, every 5 s

    @property
    def server_errors(self) -> int:
        """Every 5xx: 503 (at the connection limit, not ready) and 504 (past the request timeout) included. They are
        answers a client can act on, but a healthy server under this load gives neither."""
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> dict:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.array([np.nan])
        return {
            "seconds": round(self.seconds, 1),
            "requests": sum(self.statuses.values()),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "by_kind": dict(self.by_kind),
            "hang_ups": self.hang_ups,
            "wrong_answers": self.wrong_answers,
            "unexpected": self.unexpected[:20],
            "5xx": self.server_errors,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "rss_mb": self.rss_mb,
            "rss_growth_after_warmup": self.rss_mb["end"] / self.rss_mb["warm"] - 1,
            "rss_every_5s_mb": self.rss_series,
            "fds": self.fds,
        }


async def _client(
    port: int, probes: list[Probe], rng: random.Random, deadline: float, res: SoakResult
) -> None:
    reader = writer = None
    while time.perf_counter() < deadline:
        probe = rng.choice(probes)
        if reader is None or writer is None or writer.is_closing():
            reader, writer = await asyncio.open_connection(HOST, port)
        if probe.hang_up:
            writer.write(probe.request[: len(probe.request) // 2])
            await writer.drain()
            writer.close()
            reader = writer = None
            res.hang_ups += 1
            continue
        start = time.perf_counter()
        writer.write(probe.request)
        try:
            status, headers, body = await asyncio.wait_for(_read_response(reader), 8)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            res.unexpected.append(f"{probe.kind}: connection lost ({type(exc).__name__})")
            reader = writer = None
            continue
        res.latencies_ms.append((time.perf_counter() - start) * 1e3)
        res.statuses[status] += 1
        res.by_kind[probe.kind] += 1
        if status == 200 and probe.expected is not None and not answer_is_right(probe, headers, body):
            res.wrong_answers += 1
        refused = status in (429, 503, 504)  # load refusals are answers too
        if status not in probe.ok_statuses and not refused:
            res.unexpected.append(f"{probe.kind}: {status} {body[:120]!r}")
        if headers.get(b"connection") == b"close":
            writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


def soak(
    artifact: Path, seconds: float, clients: int = 64, seed: int = 0, warmup_s: float = 3.0
) -> SoakResult:
    """Run the mixed load for ``seconds`` against a fresh addnorm-serve on ``artifact``."""
    from addnorm.service.backend.engine import Engine

    manifest = Manifest.load(artifact)
    engine = Engine(artifact, "cpu", intra_op_threads=1)
    max_body = 8 * 1024 * 1024
    with serve(artifact, "--max-body-bytes", str(max_body)) as srv:
        probes = make_probes(srv.port, manifest, engine, np.random.default_rng(seed), max_body)
        pid = srv.proc.pid
        res = SoakResult(seconds)
        res.rss_mb["start"], res.fds["start"] = proc_rss_mb(pid), proc_fds(pid)

        async def sample(end: float, into: SoakResult) -> None:
            while time.perf_counter() < end:
                into.rss_series.append(round(proc_rss_mb(pid), 1))
                await asyncio.sleep(5.0)

        async def run(duration: float, into: SoakResult) -> None:
            end = time.perf_counter() + duration
            rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
            await asyncio.gather(sample(end, into), *(_client(srv.port, probes, r, end, into) for r in rngs))

        asyncio.run(run(warmup_s, SoakResult(warmup_s)))  # allocations settle before the baseline
        res.rss_mb["warm"] = proc_rss_mb(pid)
        asyncio.run(run(seconds, res))
        time.sleep(1.0)  # let closed connections be reaped
        res.rss_mb["end"], res.fds["end"] = proc_rss_mb(pid), proc_fds(pid)
    return res


def burst(
    artifact: Path,
    n: int = 16,
    seq: int = 4096,
    settle_s: float = 10.0,
    flags: tuple[str, ...] = (),
    padded: bool = False,
) -> dict:
    """Resident memory before, at the peak of, and after ``n`` concurrent [1, seq, d_model] requests (``padded``:
    each over V2 with its first position masked, which makes every attention form hold its seq x seq tensors; a
    row's trailing padding would be cut off, never computed)."""
    manifest = Manifest.load(artifact)
    x = np.random.default_rng(0).standard_normal((1, seq, manifest.config.d_model)).astype("<f4")
    headers = {"Content-Type": "application/octet-stream", "X-Shape": ",".join(map(str, x.shape))}
    with serve(artifact, "--request-timeout-s", "600", *flags) as srv:
        pid = srv.proc.pid
        if padded:
            request = _v2_binary(srv.port, manifest.name, x, np.arange(seq)[None, :] == 0)
        else:
            request = build_request(
                HOST, srv.port, "/v1/encode", x.tobytes(), {**headers, "Accept": "application/octet-stream"}
            )
        out = {"before_mb": proc_rss_mb(pid), "statuses": Counter()}
        peak = out["before_mb"]

        async def one() -> int:
            reader, writer = await asyncio.open_connection(HOST, srv.port)
            writer.write(request)
            status, _, _ = await _read_response(reader)
            writer.close()
            return status

        async def main() -> list[int]:
            nonlocal peak
            task = asyncio.gather(*(one() for _ in range(n)))
            while not task.done():
                peak = max(peak, proc_rss_mb(pid))
                await asyncio.sleep(0.05)
            return await task

        start = time.perf_counter()
        out["statuses"] = dict(Counter(asyncio.run(main())))
        out["burst_s"] = time.perf_counter() - start
        out["peak_mb"] = peak
        out["after_1s_mb"] = (time.sleep(1.0), proc_rss_mb(pid))[1]
        out["after_2s_mb"] = (time.sleep(1.0), proc_rss_mb(pid))[1]
        time.sleep(max(0.0, settle_s - 2.0))
        out[f"after_{settle_s:g}s_mb"] = proc_rss_mb(pid)
        out["after_over_before"] = out[f"after_{settle_s:g}s_mb"] / out["before_mb"]
    return out
