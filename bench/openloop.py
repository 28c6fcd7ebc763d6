"""python -m bench.openloop: latency against offered load, with requests that arrive on their own (an open loop).

Every other load here is closed-loop: a client sends its next request when its last is answered, so a slow server
slows its clients down and the queueing a public endpoint sees never builds up (coordinated omission). Here
requests arrive at random (a Poisson process, seeded) at a fixed rate whatever the server does, over V2 binary on
up to ``MAX_CONNECTIONS`` keep-alive connections; a request's latency counts from the moment it was due to be sent,
so time spent waiting for a free connection is latency too. Each request is ``--sentences`` sentences whose lengths
are drawn like real text (``bench.mixed.draw``; with more than one, padded to their longest with a mask, as
``bench.batched``). Rates are fractions (``--load``) of the unpadded limit's request rate (each sentence alone
in-process, no batching: ``bench.mixed.unpadded_limit``), so a table reads the same on a faster machine.

Servers, one at a time, each with every rate in turn: the artifact merging requests by cost (the default), the
same merging whatever fits (``--merge-lengths pad``, the behaviour before merging by cost), the packed twin
(``bench.mixed.packed_twin``) and, with ``--before DIR``, the artifact served by another checkout. Per server and
rate, medians of ``--rounds``: requests per second offered and answered (over the time to the last answer: an
overloaded server's backlog drains after the arrivals stop), real tokens per second answered against the unpadded
limit, p50/p90/p99 latency of the answered requests, and how many were shed (429: the queue's bound; 503: the connection limit),
timed out (504) or not answered by the end of the drain. A server that keeps up answers what is offered with a
p99 near its p50; one that does not answers less, and its latency grows with the run's length.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.artifact import Manifest
from bench.ab import started
from bench.batched import batches, medians
from bench.loadgen import _read_response
from bench.measure import v2_request
from bench.mixed import REQUESTS, draw, packed_twin, unpadded_limit
from bench.report import artifact_given, save
from bench.server import HOST, ROOT

MAX_CONNECTIONS = (
    512  # more than the queue holds (256: a server sheds the rest, 429); beyond, a request waits here
)
IDLE_S = 3.0  # a connection idle this long is closed, not reused: the server closes idle ones after 5 s
DRAIN_S = 30.0  # after the last arrival, how long the answers of the requests in flight are waited for
LOADS = (0.25, 0.5, 0.75, 1.0, 1.25)  # offered load, as fractions of the unpadded limit's request rate


def arrivals(rate: float, seconds: float, seed: int = 0) -> np.ndarray:
    """The times (s, from 0) at which requests arrive within ``seconds``: a Poisson process of ``rate`` per second."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, int(rate * seconds * 1.5) + 16))
    while times[-1] < seconds:  # a slow draw: carry on from the last
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, 64))])
    return times[times < seconds]


@dataclass
class OpenResult:
    """One open-loop load: what was offered and what came back."""

    offered: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)  # of the requests answered 200
    tokens: int = 0  # real tokens of the requests answered 200
    statuses: collections.Counter = field(default_factory=collections.Counter)  # 0: the connection failed
    unanswered: int = 0  # still in flight when the drain ended
    lag_ms: float = 0.0  # how far behind its schedule the sender fell at worst (a busy client machine)
    took: float = (
        0.0  # from the first arrival to the last answer: ``seconds`` or more, when a backlog drained
    )

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def row(self) -> dict:
        return {
            "offered_rps": self.offered / self.seconds,
            "answered_rps": self.statuses[200] / max(self.took, self.seconds),
            "tokens_per_s": self.tokens / max(self.took, self.seconds),
            "p50_ms": self.pct(50),
            "p90_ms": self.pct(90),
            "p99_ms": self.pct(99),
            "shed": self.statuses[429] + self.statuses[503],
            "timed_out": self.statuses[504],
            "failed": sum(n for s, n in self.statuses.items() if s not in (200, 429, 503, 504))
            + self.unanswered,
            "lag_ms": self.lag_ms,
        }


def open_load(
    port: int, requests: list[tuple[int, bytes]], rate: float, seconds: float, seed: int = 0
) -> OpenResult:
    """``requests`` ((real tokens, request bytes), in turn) arriving at ``rate`` per second for ``seconds``."""
    return asyncio.run(_open_load(port, requests, arrivals(rate, seconds, seed), seconds))


async def _open_load(port: int, requests: list, times: np.ndarray, seconds: float) -> OpenResult:
    res = OpenResult(offered=len(times), seconds=seconds)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []  # last used last
    slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def one(due: float, tokens: int, request: bytes) -> None:
        async with slots:
            # the oldest idle connections first: the server may be about to close them
            while idle and time.perf_counter() - idle[0][2] > IDLE_S:
                idle.pop(0)[1].close()
            writer = None
            try:
                reader, writer, _ = idle.pop() if idle else (*await asyncio.open_connection(HOST, port), 0.0)
                writer.write(request)
                status, _ = await _read_response(reader)
            except (OSError, asyncio.IncompleteReadError):
                if writer is not None:
                    writer.close()
                res.statuses[0] += 1
                return
            res.statuses[status] += 1
            res.took = max(res.took, time.perf_counter() - start)
            if status == 200:
                res.latencies_ms.append((time.perf_counter() - due) * 1e3)
                res.tokens += tokens
            idle.append((reader, writer, time.perf_counter()))

    start = time.perf_counter()
    tasks = []
    for i, at in enumerate(times):
        due = start + float(at)
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            res.lag_ms = max(res.lag_ms, -wait * 1e3)
        tasks.append(asyncio.create_task(one(due, *requests[i % len(requests)])))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
        res.unanswered = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for _, writer, _ in idle:
        writer.close()
    return res


def measure(
    artifact: Path,
    sentences: int,
    loads: tuple[float, ...],
    rounds: int,
    seconds: float,
    before: Path | None,
    packed: bool = True,
) -> dict:
    """Every server x offered load, ``rounds`` times, servers one at a time; per cell the median row."""
    manifest = Manifest.load(artifact)
    e = manifest.config.d_model
    if sentences == 1:
        rng = np.random.default_rng(1)
        sent = [(rng.standard_normal((1, int(n), e)).astype(np.float32), None) for n in draw(REQUESTS)]
    else:
        sent = batches(e, sentences)
    real = [sum(_lengths(x, m)) for x, m in sent]
    alone = [x[i : i + 1, :n] for x, m in sent for i, n in enumerate(_lengths(x, m))]
    servers: dict[str, tuple[Path, Path, dict[str, str]]] = {
        "cost": (artifact.resolve(), ROOT, {}),
        "pad": (artifact.resolve(), ROOT, {"ADDNORM_MERGE_LENGTHS": "pad"}),
    }
    if packed:
        servers["packed"] = (packed_twin(artifact).resolve(), ROOT, {})
    if before is not None:
        servers["before"] = (artifact.resolve(), before.resolve(), {})
    cells: dict[str, list[dict]] = {}
    limits = []
    for r in range(rounds):
        limits.append(unpadded_limit(artifact, alone))
        rate = limits[-1] / (sum(real) / len(real))  # requests per second at the limit
        for name, (served, tree, env) in servers.items():
            with started(tree, served, env) as port:  # served by its own checkout's code
                load = [
                    (n, v2_request(port, manifest.name, x, m)) for n, (x, m) in zip(real, sent, strict=True)
                ]
                open_load(port, load, min(rate, 50.0), 1.0, seed=99)  # warm-up, not counted
                for k, share in enumerate(loads):
                    row = open_load(port, load, share * rate, seconds, seed=r * 100 + k).row()
                    cells.setdefault(f"{name}/{share:g}", []).append(row)
                    _quiet(port)  # a backlog from an overload clears before the next rate
            print(f"  round {r + 1}: {name} done", file=sys.stderr, flush=True)
    return {
        "sentences": sentences,
        "mean_tokens": sum(real) / len(real),
        "unpadded_limit_tokens_per_s": statistics.median(limits),
        "unpadded_limits": limits,
        "seconds": seconds,
        "cells": medians(cells),
        "rounds": rounds,
    }


def _lengths(x: np.ndarray, mask: np.ndarray | None) -> list[int]:
    return [x.shape[1]] * x.shape[0] if mask is None else [int(n) for n in (~mask).sum(axis=1)]


def _quiet(port: int, wait_s: float = 60.0) -> None:
    """Wait until the server's queue is empty (its ``addnorm_queue_depth`` gauges read 0; or its metrics cannot
    be read)."""
    import urllib.request

    deadline = time.perf_counter() + wait_s
    while time.perf_counter() < deadline:
        try:
            text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return
        depths = [
            float(s.rsplit(" ", 1)[1]) for s in text.splitlines() if s.startswith("addnorm_queue_depth")
        ]
        if not any(depths):
            return
        time.sleep(0.2)


def table(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lines = [
        f"{res['sentences']} sentence(s) per request, {res['mean_tokens']:.1f} real tokens on average; the unpadded "
        f"limit {limit:,.0f} tokens/s, {limit / res['mean_tokens']:,.1f} requests/s (rounds: "
        f"{', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])}); {res['seconds']:g} s per rate",
        "",
        f"{'server':<8} {'load':>5} {'offered/s':>9} {'answered/s':>10} {'tokens/s':>9} {'vs limit':>8} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'shed':>5} {'504':>4} {'failed':>6}",
    ]
    for key, row in res["cells"].items():
        name, share = key.split("/")
        lines.append(
            f"{name:<8} {float(share):>4.2f}x {row['offered_rps']:>9.1f} {row['answered_rps']:>10.1f} "
            f"{row['tokens_per_s']:>9,.0f} {row['tokens_per_s'] / limit:>7.2f}x {row['p50_ms']:>8.1f} "
            f"{row['p90_ms']:>8.1f} {row['p99_ms']:>8.1f} {row['shed']:>5.0f} {row['timed_out']:>4.0f} "
            f"{row['failed']:>6.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.openloop", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="an exported artifact")
    p.add_argument("--sentences", type=int, default=1, help="sentences per request (default 1)")
    p.add_argument(
        "--load",
        type=float,
        nargs="+",
        default=list(LOADS),
        help="offered loads, fractions of the unpadded limit's request rate (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (default 3)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per rate (default 6)")
    p.add_argument("--no-packed", action="store_true", help="leave out the packed twin")
    p.add_argument("--before", type=Path, help="another checkout: its server on the artifact too")
    p.add_argument("--results", type=Path, default=Path("bench/results"), help="where openloop.json goes")
    args = p.parse_args(argv)
    artifact_given(p, args.artifact)
    if args.sentences < 1 or args.rounds < 1 or args.seconds <= 0 or min(args.load) <= 0:
        p.error("--sentences and --rounds must be at least 1, --seconds and every --load above 0")
    res = measure(
        args.artifact,
        args.sentences,
        tuple(args.load),
        args.rounds,
        args.seconds,
        args.before,
        packed=not args.no_packed,
    )
    save(res, args.results, "openloop.json")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
