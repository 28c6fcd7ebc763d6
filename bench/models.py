"""Two models sharing the cores (issue 28): the same total work on one model, then split across two, alternating.

    python -m bench --models            (also a section of python -m bench)

One server serves two copies of the artifact ("encoder" and "encoder-b"). Each round measures, back to back,
``alone`` (every client on encoder) and ``both`` (half the clients on each model, at the same time), for the small
payload (CLIENTS x [1,16,E]) and the big one (2 clients x [8,128,E]), on three servers started together and
measured in turn: the default (each model an equal share of the thread budget, so two busy models run side by
side on their own cores), every model on all cores taking turns (``--intra-op-threads`` = the cores), and every
model on all cores at once (``--thread-budget 64``: the pools oversubscribe the cores, as before the budget).
The figures: total requests per second, both / alone on the same server, and both / one model alone on every
core (the second server's alone, same round), medians over the rounds.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from addnorm.service.backend.cores import default_threads
from bench.loadgen import run_loads
from bench.server import HOST, ServerProcess

REPEATS = 3
SERVERS = {
    "equal shares (default)": ((), {}),
    "all cores each, turns": (("--intra-op-threads", str(default_threads())), {}),
    "all cores each, at once": (("--intra-op-threads", str(default_threads()), "--thread-budget", "64"), {}),
}


def _repository(artifact: Path, into: Path) -> Path:
    """The artifact twice, the second named encoder-b (the manifest's name is not hashed)."""
    shutil.copytree(artifact, into / "a")
    shutil.copytree(artifact, into / "b")
    manifest = into / "b" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["name"] = "encoder-b"
    manifest.write_text(json.dumps(doc))
    return into


def _load(port: int, requests: dict[str, bytes], clients: dict[str, int], seconds: float) -> float:
    """Closed-loop clients on each model at once; total requests per second."""
    loads = [(port, requests[m], n) for m, n in clients.items() if n]
    return sum(r.throughput for r in run_loads(HOST, loads, seconds))


REFERENCE = "all cores each, turns"  # its ``alone``: one model with every core, the other idle


def measure_models(s, clients: int) -> dict:
    """Every server started at once and measured in turn, REPEATS rounds: per server and payload the median of
    alone, both, both / alone, and both / the reference server's alone of the same round (one model on every
    core: the issue's "one model alone on the same total work")."""
    from bench.measure import v2_request

    payloads = {"small": (s.x_small, clients), "big": (s.x_big, 2)}
    rows = {srv: {k: {"alone": [], "both": []} for k in payloads} for srv in SERVERS}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        repo = _repository(Path(s.artifact), Path(tmp))
        servers = {}
        for name, (flags, env) in SERVERS.items():
            args = [
                "-m",
                "addnorm.service",
                "--model-repository",
                str(repo),
                "--max-batch-size",
                str(clients),
                *flags,
            ]
            servers[name] = stack.enter_context(ServerProcess(args, env=env, capture=False))
        for _ in range(REPEATS):
            for name, srv in servers.items():
                for key, (x, c) in payloads.items():
                    requests = {m: v2_request(srv.port, m, x) for m in ("encoder", "encoder-b")}
                    rows[name][key]["alone"].append(
                        _load(srv.port, requests, {"encoder": c, "encoder-b": 0}, s.seconds)
                    )
                    rows[name][key]["both"].append(
                        _load(srv.port, requests, {"encoder": c // 2, "encoder-b": c - c // 2}, s.seconds)
                    )
    out: dict = {}
    for name, by_payload in rows.items():
        out[name] = {}
        for key, r in by_payload.items():
            ref = rows[REFERENCE][key]["alone"]
            out[name][key] = {
                "alone": statistics.median(r["alone"]),
                "both": statistics.median(r["both"]),
                "ratio": statistics.median(b / a for b, a in zip(r["both"], r["alone"], strict=True)),
                "vs_one_model": statistics.median(b / a for b, a in zip(r["both"], ref, strict=True)),
            }
    return out


def models_table(res: dict, big: str, small: str, clients: int) -> list[str]:
    lines = [
        f"two models sharing the cores: total req/s, half the clients on each model vs all on one (median of {REPEATS})",
        f"{'server':<24} {'payload':<16} {'alone':>8} {'both':>8} {'both/alone':>10} {'both/one model, all cores':>26}",
    ]
    for server, by_payload in res.items():
        for key, label in (("small", f"{clients} x {small}"), ("big", f"2 x {big}")):
            r = by_payload[key]
            lines.append(
                f"{server:<24} {label:<16} {r['alone']:8.1f} {r['both']:8.1f} {r['ratio']:9.2f}x "
                f"{r['vs_one_model']:25.2f}x"
            )
    return lines
