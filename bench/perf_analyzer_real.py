"""``python -m bench.perf_analyzer_real``: NVIDIA's perf_analyzer, unmodified, on requests of mixed
lengths drawn like real text (``bench.mixed.draw``), over HTTP, gRPC and a gRPC stream, beside bench.loadgen on the
same requests, against the unpadded limit (the same requests each run alone in-process).

perf_analyzer reads the requests from an ``--input-data`` JSON file, each entry with its own shape, and sends them
round-robin; its client is C++, so on a machine it shares with the server it takes less of the cores than ours.
"""

from __future__ import annotations

import base64
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.contract import EMBEDDINGS, MASK
from bench.batched import medians
from bench.perf_analyzer import TRANSPORTS, Unavailable, binary, run
from bench.report import artifact_given, save
from bench.server import HOST, ServerProcess

REAL_REQUESTS = 64  # requests in perf_analyzer's data file (base64: 2.4 MB at d_model 384)


def real_lengths(path: Path, d_model: int, count: int = REAL_REQUESTS, seed: int = 1) -> list[np.ndarray]:
    """Write perf_analyzer's ``--input-data`` file of ``count`` one-sequence requests whose lengths are drawn like
    real text (``bench.mixed.draw``), standard normal values in base64 and a mask of no padding, each entry with its
    own shape (perf_analyzer sends them round-robin); returns the requests' arrays, ``(1, s, d_model)`` each."""
    from bench.mixed import draw

    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((1, int(n), d_model)).astype(np.float32) for n in draw(count)]
    data = [
        {
            EMBEDDINGS: {"b64": base64.b64encode(x.tobytes()).decode(), "shape": list(x.shape[1:])},
            MASK: {"content": [False] * x.shape[1], "shape": [x.shape[1]]},
        }
        for x in xs
    ]
    path.write_text(json.dumps({"data": data}))
    return xs


class _Round(NamedTuple):
    """One round: a server at its defaults (gRPC on), the requests and their data file, the limit measured."""

    srv: ServerProcess
    model: str
    data: Path
    xs: list[np.ndarray]
    limit: float


def _rounds(artifact: Path, rounds: int) -> Iterator[_Round]:
    """``rounds`` rounds over one data file of ``real_lengths``: each measures the unpadded limit in-process, then
    starts a server for the round's loads."""
    from addnorm.model.artifact import Manifest
    from bench.mixed import unpadded_limit

    manifest = Manifest.load(artifact)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "real.json"
        xs = real_lengths(data, manifest.config.d_model)
        for r in range(rounds):
            limit = unpadded_limit(artifact, xs)
            with ServerProcess(["-m", "addnorm.service", "--artifact", str(artifact)], grpc=True) as srv:
                yield _Round(srv, manifest.name, data, xs, limit)
            print(f"  round {r + 1} done", file=sys.stderr, flush=True)


def measure_real(artifact: Path, clients: tuple[int, ...], rounds: int, seconds: float) -> dict:
    """perf_analyzer on requests of mixed lengths (``real_lengths``) over each of TRANSPORTS,
    beside bench.loadgen over HTTP on the same requests, against the unpadded limit (the same requests each run
    alone in-process, ``bench.mixed.unpadded_limit``); a server at its defaults per round, the limit measured
    before it; per cell the median over ``rounds``. perf_analyzer's tokens per second are its requests per second
    times the real tokens per request the server counted over its run (``addnorm_batch_positions`` over the
    requests of ``addnorm_batch_requests``): the requests it sent, not the data file's mean."""
    from bench.measure import v2_request
    from bench.mixed import cell, served

    command = binary()
    cells: dict[str, list[dict]] = {}
    limits: list[float] = []
    stable = ("--stability-percentage", "1000")  # three windows; the rounds give the median
    for round_ in _rounds(artifact, rounds):
        srv, flags, window = round_.srv, ["--input-data", str(round_.data)], int(seconds * 1000)
        limits.append(round_.limit)
        ours = [(x.shape[1], v2_request(srv.port, round_.model, x)) for x in round_.xs]
        for c in clients:
            cells.setdefault(f"loadgen/{c}", []).append(cell(srv.port, ours, c, seconds, "bench.loadgen")[0])
            for label, protocol, extra in TRANSPORTS:
                url = f"{HOST}:{srv.port if protocol == 'http' else srv.grpc_port}"
                before = served(srv.port)
                [pa] = run(command, url, protocol, round_.model, 1, flags, [c], window, (*stable, *extra))
                after = served(srv.port)
                tokens, requests = (after[k] - before[k] for k in ("requested", "requests"))
                row = {
                    "tokens_per_s": pa["requests_per_s"] * tokens / max(requests, 1),
                    "p50_ms": pa["p50_ms"],
                }
                cells.setdefault(f"{label}/{c}", []).append({**row, "p99_ms": pa["p99_ms"]})
    lengths = [x.shape[1] for x in round_.xs]
    lengths_seen = {"requests": len(lengths), "mean": float(np.mean(lengths)), "max": int(max(lengths))}
    return _result(command, artifact, limits, cells, lengths=lengths_seen, clients=list(clients))


def _result(command: list[str], artifact: Path, limits: list[float], cells: dict, **own: object) -> dict:
    """A run's figures: perf_analyzer and the artifact, the unpadded limit (median and rounds), each cell's median
    over the rounds, and the mode's ``own`` fields."""
    return {
        "command": command[-1],
        "artifact": str(artifact),
        "unpadded_limit_tokens_per_s": statistics.median(limits),
        "unpadded_limits": limits,
        "cells": medians(cells),
        "rounds": len(limits),
        **own,
    }


def table_real(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lines = [
        f"Unpadded limit {limit:,.0f} tokens/s (rounds: {', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])});"
        f" {res['lengths']['requests']} requests, {res['lengths']['mean']:.1f} tokens on average, the longest "
        f"{res['lengths']['max']}. Tokens/s (x the limit), p99 ms:",
        "",
        "| clients | bench.loadgen HTTP | perf_analyzer HTTP | perf_analyzer gRPC | perf_analyzer gRPC --streaming |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in res["clients"]:
        cells = [res["cells"][f"{label}/{c}"] for label in ("loadgen", *(t[0] for t in TRANSPORTS))]
        text = [
            f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / limit:.2f}x), p99 {r['p99_ms']:.0f}"
            for r in cells
        ]
        lines.append(f"| {c} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def measure_rates(artifact: Path, loads: tuple[float, ...], rounds: int, seconds: float) -> dict:
    """Open loop: perf_analyzer's own Poisson arrivals (``run(..., rates=...)``) at ``loads`` fractions of the
    unpadded limit's request rate (its tokens/s over the requests' mean length), over each of TRANSPORTS, on the
    same requests; per cell the median over ``rounds`` of the answered rate as a fraction of the offered one, and
    perf_analyzer's p50/p99 (from each request's send)."""
    command = binary()
    cells: dict[str, list[dict]] = {}
    limits: list[float] = []
    for round_ in _rounds(artifact, rounds):
        srv, flags, window = round_.srv, ["--input-data", str(round_.data)], int(seconds * 1000)
        limits.append(round_.limit)
        mean = float(np.mean([x.shape[1] for x in round_.xs]))
        for load in loads:
            rate = round(load * round_.limit / mean, 1)
            for label, protocol, extra in TRANSPORTS:
                url = f"{HOST}:{srv.port if protocol == 'http' else srv.grpc_port}"
                extra = ("--stability-percentage", "1000", *extra)
                [pa] = run(command, url, protocol, round_.model, 1, flags, [], window, extra, rates=[rate])
                row = {"answered": pa["requests_per_s"] / rate, "p50_ms": pa["p50_ms"]}
                cells.setdefault(f"{label}/{load}", []).append({**row, "p99_ms": pa["p99_ms"]})
    return _result(command, artifact, limits, cells, mean_tokens=mean, loads=list(loads))


def table_rates(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lines = [
        f"Unpadded limit {limit:,.0f} tokens/s, {limit / res['mean_tokens']:.1f} requests/s of "
        f"{res['mean_tokens']:.1f} tokens (rounds: {', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])}). "
        "Offered as a fraction of that rate; answered / offered, p50 / p99 ms:",
        "",
        "| offered | " + " | ".join(f"perf_analyzer {label}" for label, _, _ in TRANSPORTS) + " |",
        "| --- |" + " --- |" * len(TRANSPORTS),
    ]
    for load in res["loads"]:
        cells = [res["cells"][f"{label}/{load}"] for label, _, _ in TRANSPORTS]
        text = [f"{r['answered']:.2f}, {r['p50_ms']:.0f} / {r['p99_ms']:.0f}" for r in cells]
        lines.append(f"| {load:g}x | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:

    from bench.server import ROOT

    p = Parser(prog="python -m bench.perf_analyzer_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=ROOT / DEFAULT_ARTIFACT, help="an exported artifact")
    p.add_argument(
        "--clients", type=int, nargs="+", default=[1, 8, 32], help="client counts (default 1 8 32)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (default 3)")
    p.add_argument(
        "--seconds", type=float, default=3.0, help="perf_analyzer's measurement window (default 3)"
    )
    p.add_argument(
        "--loads",
        type=float,
        nargs="+",
        help="instead of closed-loop clients: open loop, Poisson arrivals at these fractions of the unpadded "
        "limit's request rate (e.g. 0.5 0.75 1.0)",
    )
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    args = p.parse_args(argv)
    artifact_given(p, args.artifact)
    try:
        if args.loads:
            res = measure_rates(args.artifact, tuple(args.loads), args.rounds, args.seconds)
            save(res, args.results, "perf_analyzer_rates.json")
            print(table_rates(res))
            return 0
        res = measure_real(args.artifact, tuple(args.clients), args.rounds, args.seconds)
    except Unavailable as exc:
        print(f"perf_analyzer is not available here: {exc}", file=sys.stderr)
        return 1
    save(res, args.results, "perf_analyzer_real.json")
    print(table_real(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
