"""``python -m bench.against``: addnorm against what people write by hand (``bench/naive_app.py``: FastAPI +
pydantic + torch eager, JSON lists in and out, one request per model call), on requests of real text's lengths.

The same requests to each server: ``REQUESTS`` single sequences ``[1, s, E]`` whose lengths are drawn like real text
(``bench.mixed.draw``), the hand-written app and addnorm's ``/v1/encode`` with the same JSON body, and addnorm's V2
binary; 1, 8 and 32 closed-loop keep-alive clients, each cycling through every request from its own offset
(``bench.mixed.http_load``); servers one at a time, each round also measuring the unpadded limit (the same requests
each run alone in onnxruntime in-process); ``--rounds`` rounds, medians. Tokens per second are the real tokens of
the requests answered; every server runs at its defaults, as a user starts it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.artifact import Manifest
from bench.batched import medians
from bench.measure import json_request, v2_request
from bench.mixed import cell, draw, unpadded_limit
from bench.report import artifact_given, save
from bench.server import HOST, ROOT, ServerProcess, serve

REQUESTS = 128  # drawn requests (their JSON bodies: about 35 MB at d_model 384)
SERVERS = ("naive JSON", "addnorm /v1 JSON", "addnorm V2 binary")


def measure(artifact: Path, clients: tuple[int, ...], rounds: int, seconds: float) -> dict:
    """Every server x client count, ``rounds`` times; per cell the median row."""
    manifest = Manifest.load(artifact)
    rng = np.random.default_rng(1)
    xs = [
        rng.standard_normal((1, int(n), manifest.config.d_model)).astype(np.float32) for n in draw(REQUESTS)
    ]
    cells: dict[str, list[dict]] = {}
    limits: list[float] = []
    for _ in range(rounds):
        limits.append(unpadded_limit(artifact, xs))
        for server in SERVERS:
            with _started(server, artifact) as srv:
                if server == "addnorm V2 binary":
                    load = [(x.shape[1], v2_request(srv.port, manifest.name, x)) for x in xs]
                else:
                    path = "/encode" if server.startswith("naive") else "/v1/encode"
                    load = [(x.shape[1], json_request(srv.port, path, x)) for x in xs]
                for c in clients:
                    cells.setdefault(f"{server}/{c}", []).append(cell(srv.port, load, c, seconds, server)[0])
            print(f"  round {len(limits)}: {server} done", file=sys.stderr, flush=True)
    lengths = [x.shape[1] for x in xs]
    return {
        "artifact": str(artifact),
        "lengths": {"requests": len(lengths), "mean": float(np.mean(lengths)), "max": int(max(lengths))},
        "unpadded_limit_tokens_per_s": statistics.median(limits),
        "unpadded_limits": limits,
        "clients": list(clients),
        "cells": medians(cells),
        "rounds": rounds,
    }


def _started(server: str, artifact: Path) -> ServerProcess:
    if server.startswith("naive"):  # uvicorn as its README would say, one worker
        cmd = ["-m", "uvicorn", "bench.naive_app:app", "--host", HOST, "--log-level", "warning"]
        srv = ServerProcess(cmd, {"ADDNORM_BENCH_ARTIFACT": str(artifact)}, ready_path="/docs", capture=False)
    else:
        srv = serve(artifact)
    return srv


def table(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lines = [
        f"Unpadded limit {limit:,.0f} tokens/s (rounds: {', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])});"
        f" {res['lengths']['requests']} requests, {res['lengths']['mean']:.1f} tokens on average, the longest "
        f"{res['lengths']['max']}. Tokens/s (x the hand-written app), p50 / p99 ms:",
        "",
        "| clients | " + " | ".join(SERVERS) + " |",
        "| --- |" + " --- |" * len(SERVERS),
    ]
    for c in res["clients"]:
        naive = res["cells"][f"{SERVERS[0]}/{c}"]["tokens_per_s"]
        text = []
        for server in SERVERS:
            r = res["cells"][f"{server}/{c}"]
            text.append(
                f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / naive:.2f}x), {r['p50_ms']:.0f} / {r['p99_ms']:.0f}"
            )
        lines.append(f"| {c} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.against", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=ROOT / DEFAULT_ARTIFACT, help="an exported artifact")
    p.add_argument(
        "--clients", type=int, nargs="+", default=[1, 8, 32], help="client counts (default 1 8 32)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (default 3)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per load (default 4)")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where against.json goes")
    args = p.parse_args(argv)
    artifact_given(p, args.artifact)
    res = measure(args.artifact, tuple(args.clients), args.rounds, args.seconds)
    save(res, args.results, "against.json")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
