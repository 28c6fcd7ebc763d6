"""The service against its two limits, side by side: phases alternating, median of the rounds.

1. V2 binary [8,128,E], one keep-alive client, against in-process onnxruntime on the same array (the limit for
   one request at a time, spinning within its run as the server's run of a lone request does at its defaults):
   in-process call and server request alternate one by one;
2. 32 keep-alive clients x V2 binary [1,16,E] with batching on, against the perfect-batching limit (in-process
   batches of 32 such requests, per request: one run on every thread, or as many runs side by side as the server
   has threads, one thread each, as ``--parallel-runs on`` runs them under load, the faster of the two each
   round); the same load over gRPC with each client's requests on one
   ModelStreamInfer stream (``/stream``) beside it, against the same limit.

Each round alternates the in-process limit with every server (one per configuration: the defaults, and any
``--against`` settings): call by call for the single client, in ``SLICES`` slices for the 32 clients, so that the
machine's drift (10-20% here, over seconds) hits both sides of a ratio alike; the ratio is taken per round and
the median over rounds is the one reported. Under the table, issue 77's goals of this section (``goals``).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from bench.goals import LOOP_MS, TINY_V2_VS_PERFECT, section, verdict
from bench.grpc_load import grpc_request, run_grpc_load
from bench.measure import (
    CLIENTS,
    Setup,
    batch_histogram,
    limit_engines,
    load_with_cpu,
    process_cpu_s,
    timed,
    v2_request,
)
from bench.server import HOST, serve

SLICES = 2  # alternations per round (each slice of a load phase starts with a ramp of a batch or two)


def combine(rows: list[dict]) -> dict:
    """Slices of one load phase as one: throughput and CPU per request over all of them."""
    n = sum(r["requests"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    per = lambda key: sum(r[key] * r["requests"] for r in rows) / max(n, 1)  # noqa: E731
    return {
        "requests": n,
        "seconds": seconds,
        "throughput_rps": n / seconds,
        "server_cpu_ms_per_request": per("server_cpu_ms_per_request"),
        "loop_cpu_ms_per_request": per("loop_cpu_ms_per_request"),
    }


def per_second(ms: list[np.ndarray], items: int) -> float:
    """Items per second of in-process calls: all calls over all their time, as a server's throughput is counted
    (a median per call would leave out the slow calls that the server's figure includes)."""
    calls = np.concatenate(ms)
    return items * len(calls) / (calls.sum() / 1e3)


class OneClient:
    """One keep-alive connection: each call sends the prebuilt request and reads the whole answer (200 or raises)."""

    def __init__(self, port: int, request: bytes) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.request = request

    def __call__(self) -> None:
        self.sock.sendall(self.request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self._recv()
        head, body = data.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {head[:40]!r}")
        length = next(
            int(v)
            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
        while len(body) < length:
            body += self._recv()

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def alternate_one_by_one(engine, x: np.ndarray, servers: dict, requests: dict, seconds: float) -> dict:
    """In-process call, then one request to each server, over and over for about ``seconds``: each side's
    throughput over its own time, and each server's CPU per request from the OS."""
    clients = {label: OneClient(srv.port, requests[label]) for label, srv in servers.items()}
    try:
        for fn in (lambda: engine.run(x), *clients.values()):  # warm-up
            fn()
        times: dict = {"inproc": [], **{label: [] for label in servers}}
        cpu0 = {
            label: (process_cpu_s(srv.proc.pid), process_cpu_s(srv.proc.pid, srv.proc.pid))
            for label, srv in servers.items()
        }
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times["inproc"]) < 3:
            for label, fn in (("inproc", lambda: engine.run(x)), *clients.items()):
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
    finally:
        for c in clients.values():
            c.close()
    out = {"inproc": len(times["inproc"]) / sum(times["inproc"])}
    for label, srv in servers.items():
        n = len(times[label])
        total, loop = process_cpu_s(srv.proc.pid), process_cpu_s(srv.proc.pid, srv.proc.pid)
        out[label] = {
            "requests": n,
            "seconds": sum(times[label]),
            "throughput_rps": n / sum(times[label]),
            "server_cpu_ms_per_request": (total - cpu0[label][0]) * 1e3 / n,
            "loop_cpu_ms_per_request": (loop - cpu0[label][1]) * 1e3 / n,
        }
    return out


def measure_limits(s: Setup, configs: dict[str, dict[str, str]], rounds: int = 3) -> dict:
    """``configs``: label -> ADDNORM_* settings of one server. Returns per-round rows and per-server medians."""
    from addnorm.service.backend.engine import Engine

    # perfect batching: a loaded server's runs sleep between sections; one client's runs are at light load, and spin
    # at the server's defaults
    (engine, *side), lone = limit_engines(s.artifact), Engine(s.artifact, "cpu", spinning="in-run")
    rng = np.random.default_rng(1)
    x32 = rng.standard_normal((CLIENTS, *s.x_small.shape[1:])).astype(np.float32)
    out: dict = {"rounds": [], "servers": {}}
    with contextlib.ExitStack() as stack:
        perfect = {"one run": lambda: engine.run(x32)}
        if side:  # the 32 requests dealt to the lanes, their runs side by side
            (lanes,) = side
            pool = stack.enter_context(ThreadPoolExecutor(lanes.lanes))
            shares = np.array_split(x32, lanes.lanes)
            perfect["side by side"] = lambda: list(pool.map(lanes.run, shares))
        servers = {
            label: stack.enter_context(
                serve(s.artifact, grpc=True, env={"ADDNORM_MAX_BATCH_SIZE": str(CLIENTS), **env})
            )
            for label, env in configs.items()
        }
        requests = {
            label: (v2_request(srv.port, s.name, s.x_big), v2_request(srv.port, s.name, s.x_small))
            for label, srv in servers.items()
        }
        streamed = grpc_request(s.name, s.x_small)
        for _ in range(rounds):
            big = alternate_one_by_one(
                lone, s.x_big, servers, {k: v[0] for k, v in requests.items()}, s.seconds * len(servers)
            )
            perfect_ms: dict = {way: [] for way in perfect}
            perfect_cpu_s = dict.fromkeys(perfect, 0.0)
            slices: dict = {label: {"small": [], "stream": [], "runs": 0.0, "rows": 0.0} for label in servers}
            for _ in range(SLICES):
                for way, run in perfect.items():  # each way of the limit its share of the slice
                    cpu0 = time.process_time()  # this process: the engine's threads, nothing else running
                    perfect_ms[way].append(timed(run, s.seconds / SLICES / len(perfect), min_runs=2))
                    perfect_cpu_s[way] += time.process_time() - cpu0
                for label, srv in servers.items():
                    before = batch_histogram(srv.port)
                    slices[label]["small"].append(
                        load_with_cpu(srv, requests[label][1], CLIENTS, s.seconds / SLICES)
                    )
                    after = batch_histogram(srv.port)
                    slices[label]["runs"] += after["count"] - before["count"]
                    slices[label]["rows"] += after["sum"] - before["sum"]
                    slices[label]["stream"].append(
                        load_with_cpu(srv, streamed, CLIENTS, s.seconds / SLICES, partial(_stream, srv))
                    )
            rates = {way: per_second(ms, CLIENTS) for way, ms in perfect_ms.items()}
            way = max(rates, key=rates.__getitem__)
            calls = sum(len(ms) + 2 for ms in perfect_ms[way])  # timed() makes two warm-up calls first
            r: dict = {
                "inproc_big": big["inproc"],
                "perfect": rates[way],
                "perfect_way": way,
                "perfect_rates": rates,
                "perfect_cpu_ms_per_request": perfect_cpu_s[way] * 1e3 / (calls * CLIENTS),
            }
            for label, sl in slices.items():
                r[f"{label}/big"] = big[label]
                r[f"{label}/small"] = combine(sl["small"])
                r[f"{label}/small"]["mean_rows_per_run"] = sl["rows"] / sl["runs"] if sl["runs"] else 0.0
                r[f"{label}/stream"] = combine(sl["stream"])
            out["rounds"].append(r)
    for label in configs:
        big = [r[f"{label}/big"]["throughput_rps"] / r["inproc_big"] for r in out["rounds"]]
        small = [r[f"{label}/small"]["throughput_rps"] / r["perfect"] for r in out["rounds"]]
        stream = [r[f"{label}/stream"]["throughput_rps"] / r["perfect"] for r in out["rounds"]]
        out["servers"][label] = {
            "settings": configs[label],
            "v2_binary_vs_inproc": big,
            "batching_vs_perfect": small,
            "stream_vs_perfect": stream,
            "median": {
                "v2_binary_vs_inproc": statistics.median(big),
                "batching_vs_perfect": statistics.median(small),
                "stream_vs_perfect": statistics.median(stream),
                "server_cpu_ms_stream": statistics.median(
                    r[f"{label}/stream"]["server_cpu_ms_per_request"] for r in out["rounds"]
                ),
                "rows_per_run": statistics.median(
                    r[f"{label}/small"]["mean_rows_per_run"] for r in out["rounds"]
                ),
                "loop_cpu_ms_small": statistics.median(
                    r[f"{label}/small"]["loop_cpu_ms_per_request"] for r in out["rounds"]
                ),
                "server_cpu_ms_small": statistics.median(
                    r[f"{label}/small"]["server_cpu_ms_per_request"] for r in out["rounds"]
                ),
                "perfect_cpu_ms": statistics.median(r["perfect_cpu_ms_per_request"] for r in out["rounds"]),
            },
        }
    return out


def _stream(srv, request: bytes, clients: int, seconds: float):
    """``clients`` closed-loop gRPC clients, each sending ``request`` on one ModelStreamInfer call."""
    return run_grpc_load(srv.grpc_port, request, clients, seconds, stream=True)


def limits_table(res: dict, big: str, small: str) -> list[str]:
    n = len(res["rounds"])
    lines = [
        f"| server (alternating with in-process, median of {n}) | V2 binary [{big}] / in-process (each round) "
        f"| {CLIENTS} x [{small}] batching / perfect limit (each round) | rows per run | server CPU ms/request "
        "| perfect limit CPU ms/request | event-loop ms/request | the same over gRPC streams / perfect limit "
        "| server CPU ms/request |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in res["servers"].items():
        m = r["median"]
        name = label if not r["settings"] else " ".join(f"{k}={v}" for k, v in r["settings"].items())
        each = lambda key, r=r: ", ".join(f"{v:.2f}" for v in r[key])  # noqa: E731
        lines.append(
            f"| {name} | {m['v2_binary_vs_inproc']:.2f}x ({each('v2_binary_vs_inproc')}) "
            f"| {m['batching_vs_perfect']:.2f}x ({each('batching_vs_perfect')}) | {m['rows_per_run']:.1f} "
            f"| {m['server_cpu_ms_small']:.2f} | {m['perfect_cpu_ms']:.2f} | {m['loop_cpu_ms_small']:.3f} "
            f"| {_stream_cells(r)} |"
        )
    if "perfect_rates" in res["rounds"][0]:  # results from before the side-by-side way have one way
        each = "; ".join(
            ", ".join(f"{way} {rate:,.0f}" for way, rate in r["perfect_rates"].items()) for r in res["rounds"]
        )
        lines += ["", f"The perfect limit's ways each round, requests/s (the faster counts): {each}."]
    return lines + goals(res, small)


def goals(res: dict, small: str) -> list[str]:
    """Issue 77's goals of this section, judged on the server at its defaults (one without ``--against``
    settings): 32 clients of tiny V2 binary requests against the perfect-batching limit, with the CPU a request
    beside it, and the event loop's CPU a request."""
    out = []
    for r in res["servers"].values():
        if r["settings"]:
            continue
        m = r["median"]
        ratio, loop = m["batching_vs_perfect"], m["loop_cpu_ms_small"]
        out += [
            f"- V2 binary, {CLIENTS} clients x [{small}], against the perfect-batching limit: {ratio:.2f}x, "
            f"{verdict(ratio, '>=', TINY_V2_VS_PERFECT, 'x')} (the server's CPU {m['server_cpu_ms_small']:.2f} ms a "
            f"request against the limit's {m['perfect_cpu_ms']:.2f} ms, {m['rows_per_run']:.1f} rows a run)",
            f"- the event loop's CPU a V2 binary [{small}] request at {CLIENTS} clients: {loop:.3f} ms, "
            f"{verdict(loop, '<=', LOOP_MS, ' ms')}",
        ]
    return section(out)


def _stream_cells(r: dict) -> str:
    """The gRPC stream's cells (results from before it was measured have none)."""
    m = r["median"]
    if "stream_vs_perfect" not in m:
        return "- | -"
    each = ", ".join(f"{v:.2f}" for v in r["stream_vs_perfect"])
    return f"{m['stream_vs_perfect']:.2f}x ({each}) | {m['server_cpu_ms_stream']:.2f}"
