"""python -m bench --ray: Ray Serve with one replica against plain addnorm-serve, same artifact, same requests.

Both servers run at once and the load phases alternate between them (plain, Ray, Ray, plain, ...), so drift
on a noisy machine hits both alike; each ratio is the median over the repetitions. CPU per request is read from
the OS for each process: the plain server, and Ray's proxy, replica and the rest of its processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.loadgen import run_load
from bench.measure import CLIENTS, Setup, batch_histogram, process_cpu_s, v2_request
from bench.server import HOST, ServerProcess, serve

REPS = 3


def ray_server(artifact: Path, replicas: int, num_cpus: int) -> ServerProcess:
    args = ["-m", "bench.ray_driver", "--artifact", str(artifact), "--replicas", str(replicas)]
    return ServerProcess([*args, "--num-cpus", str(num_cpus)])


def process_tree(root: int) -> dict[int, str]:
    """Every process under ``root`` (itself included), by pid, with its title (Ray names its workers)."""
    parents: dict[int, int] = {}
    titles: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid = int(stat.parent.name)
            parents[pid] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            titles[pid] = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return {pid: titles.get(pid, "") for pid in tree}


def _role(title: str) -> str:
    if "ProxyActor" in title:
        return "proxy"
    if "ServeReplica" in title:
        return "replica"
    return "other"


def cpu_by_role(pids: dict[int, str]) -> dict[str, float]:
    out = {"proxy": 0.0, "replica": 0.0, "other": 0.0}
    for pid, title in pids.items():
        try:
            out[_role(title)] += process_cpu_s(pid)
        except OSError:  # a process that ended meanwhile
            continue
    return out


def phase(srv: ServerProcess, request: bytes, clients: int, seconds: float, pids: dict[int, str]) -> dict:
    """One load phase; the CPU each role of ``pids`` used, per request."""
    before, hist0 = cpu_by_role(pids), batch_histogram(srv.port)
    row = run_load(HOST, srv.port, request, clients, seconds).row()
    after, hist1 = cpu_by_role(pids), batch_histogram(srv.port)
    n = max(row["requests"], 1)
    row["cpu_ms_per_request"] = {k: (after[k] - before[k]) * 1e3 / n for k in after}
    runs = hist1["count"] - hist0["count"]
    row["mean_rows_per_run"] = (hist1["sum"] - hist0["sum"]) / runs if runs else 0.0
    return row


def measure_ray(s: Setup) -> dict:
    """Plain addnorm-serve and Ray Serve (1 replica, all cores) on [8,128,E] x 1 client and [1,16,E] x 32."""
    loads = {"big": (s.x_big, 1), "small": (s.x_small, CLIENTS)}
    out: dict = {name: {"plain": [], "ray": []} for name in loads}
    with serve(s.artifact) as plain, ray_server(s.artifact, 1, s.threads) as ray:
        trees = {"plain": {plain.proc.pid: "addnorm-serve"}, "ray": process_tree(ray.proc.pid)}
        servers = {"plain": plain, "ray": ray}
        for rep in range(REPS):
            order = ("plain", "ray") if rep % 2 == 0 else ("ray", "plain")
            for name, (x, clients) in loads.items():
                for which in order:
                    req = v2_request(servers[which].port, s.name, x)
                    out[name][which].append(phase(servers[which], req, clients, s.seconds, trees[which]))
    for name in loads:
        pairs = zip(out[name]["ray"], out[name]["plain"], strict=True)
        out[name]["ray_vs_plain"] = float(
            np.median([r["throughput_rps"] / p["throughput_rps"] for r, p in pairs])
        )
    return out


def ray_table(res: dict) -> str:
    lines = [
        "| load | plain req/s | Ray req/s | Ray / plain (median of 3) | plain CPU ms/req | "
        "Ray CPU ms/req: proxy | replica | other Ray processes | rows per run: plain | Ray |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {"big": "[8,128,E] x 1 client", "small": f"[1,16,E] x {CLIENTS} clients"}
    for name, label in labels.items():
        row = res[name]
        med = lambda rows, f: float(np.median([f(r) for r in rows]))  # noqa: E731
        plain_rps = med(row["plain"], lambda r: r["throughput_rps"])
        ray_rps = med(row["ray"], lambda r: r["throughput_rps"])
        plain_cpu = med(row["plain"], lambda r: sum(r["cpu_ms_per_request"].values()))
        ray_cpu = {
            k: med(row["ray"], lambda r, k=k: r["cpu_ms_per_request"][k])
            for k in ("proxy", "replica", "other")
        }
        lines.append(
            f"| {label} | {plain_rps:.1f} | {ray_rps:.1f} | {row['ray_vs_plain']:.2f} | {plain_cpu:.2f} | "
            f"{ray_cpu['proxy']:.2f} | {ray_cpu['replica']:.2f} | {ray_cpu['other']:.2f} | "
            f"{med(row['plain'], lambda r: r['mean_rows_per_run']):.1f} | "
            f"{med(row['ray'], lambda r: r['mean_rows_per_run']):.1f} |"
        )
    return "\n".join(lines)
