"""Two models sharing the cores (issue 28): the same total work on one model, then split across two, alternating.

    python -m bench --models            (also a section of python -m bench)

One server serves two copies of the artifact ("encoder" and "encoder-b"). Each round measures, back to back,
``alone`` (every client on encoder) and ``both`` (half the clients on each model, at the same time), for the small
payload (CLIENTS x [1,16,E]) and the big one (2 clients x [8,128,E]). Three servers side by side: the default
(each model's runs hold the whole thread budget, so two busy models take turns), ``--thread-budget 64`` (no
effective budget: both models' pools run at once on twice the threads there are cores, as before the budget),
and ``--model-threads encoder=1,encoder-b=1`` (a core each, side by side). The figure is both / alone, total
requests per second, median over the rounds.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
from pathlib import Path

from bench.loadgen import run_load
from bench.server import HOST, serve

REPEATS = 3
SERVERS = {
    "budget (default)": (),
    "no budget (before)": ("--thread-budget", "64"),
    "a core each": ("--model-threads", "encoder=1,encoder-b=1"),
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
    results: dict[str, float] = {}

    def one(model: str) -> None:
        results[model] = run_load(HOST, port, requests[model], clients[model], seconds).throughput

    threads = [threading.Thread(target=one, args=(m,)) for m in clients if clients[m]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(results.values())


def measure_models(s, clients: int) -> dict:
    from bench.measure import v2_request

    payloads = {"small": (s.x_small, clients), "big": (s.x_big, 2)}
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = _repository(Path(s.artifact), Path(tmp))
        for server, flags in SERVERS.items():
            rows: dict = {k: {"alone": [], "both": [], "ratio": []} for k in payloads}
            with serve(
                repo, "--model-repository", str(repo), "--max-batch-size", str(clients), *flags
            ) as srv:
                for _ in range(REPEATS):
                    for key, (x, c) in payloads.items():
                        requests = {m: v2_request(srv.port, m, x) for m in ("encoder", "encoder-b")}
                        alone = _load(srv.port, requests, {"encoder": c, "encoder-b": 0}, s.seconds)
                        both = _load(
                            srv.port, requests, {"encoder": c // 2, "encoder-b": c - c // 2}, s.seconds
                        )
                        rows[key]["alone"].append(alone)
                        rows[key]["both"].append(both)
                        rows[key]["ratio"].append(both / alone)
            out[server] = {
                k: {f: statistics.median(v[f]) for f in ("alone", "both", "ratio")} for k, v in rows.items()
            }
    return out


def models_table(res: dict, big: str, small: str, clients: int) -> list[str]:
    lines = [
        f"two models sharing the cores: total req/s, half the clients on each model vs all on one (median of {REPEATS})",
        f"{'server':<22} {'payload':<26} {'alone':>8} {'both':>8} {'both/alone':>10}",
    ]
    for server, by_payload in res.items():
        for key, label in (("small", f"{clients} x {small}"), ("big", f"2 x {big}")):
            r = by_payload[key]
            lines.append(f"{server:<22} {label:<26} {r['alone']:8.1f} {r['both']:8.1f} {r['ratio']:10.2f}x")
    return lines
