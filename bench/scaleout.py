"""python -m bench --ray: Ray Serve with one replica against plain addnorm-serve, same artifact, same requests.

Plain addnorm-serve runs throughout; each Ray setup in turn runs beside it, alone, and the load phases alternate
between the two (plain, Ray, Ray, plain, ...), so drift on a noisy machine hits both alike; each ratio is the median
over the repetitions. CPU per request is read from the OS for each process: the plain server, and Ray's proxy,
replica and the rest of its processes. Under the table, issue 77's goal of this section (``goals``).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.goals import RAY_VS_PLAIN, section, verdict
from bench.loadgen import run_loads
from bench.measure import CLIENTS, Setup, batch_histogram, process_cpu_s, v2_request
from bench.server import HOST, ServerProcess, serve

REPS = 3


def ray_server(
    artifact: Path,
    replicas: int,
    num_cpus: int,
    ingress: str = "proxy",
    span: str | None = None,
    ports_file: Path | None = None,
) -> ServerProcess:
    """A ray_driver process, its ``ingress`` one of RAY_SETUPS' ("direct" and "haproxy": the replicas on ports of
    ``span``, LO:HI, written to ``ports_file`` once all answer)."""
    args = ["-m", "bench.ray_driver", "--artifact", str(artifact), "--replicas", str(replicas)]
    if ingress != "proxy":
        flag = "--direct-ingress" if ingress == "direct" else "--haproxy"
        args += [flag, str(span), "--ports-file", str(ports_file)]
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
    if "ProxyActor" in title or Path(title).name == "haproxy":
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


def _load_split(ports: list[int], requests: dict[int, bytes], clients: int, seconds: float) -> dict:
    """``clients`` closed-loop clients split evenly across ``ports`` at once (client-side balancing over
    direct-ingress replicas); one row, throughput and requests summed, latencies from the first port."""
    shares = [clients // len(ports) + (i < clients % len(ports)) for i in range(len(ports))]
    loads = [(p, requests[p], n) for p, n in zip(ports, shares, strict=True) if n]
    rows = [r.row() for r in run_loads(HOST, loads, seconds)]
    row = dict(rows[0])
    row["throughput_rps"] = sum(r["throughput_rps"] for r in rows)
    row["requests"] = sum(r["requests"] for r in rows)
    return row


def phase(
    ports: list[int], x: np.ndarray, name: str, clients: int, seconds: float, pids: dict[int, str]
) -> dict:
    """One load phase on the server answering on ``ports``; the CPU each role of ``pids`` used, per request."""
    requests = {p: v2_request(p, name, x) for p in ports}
    before = cpu_by_role(pids)
    hist0 = [batch_histogram(p) for p in ports]
    row = _load_split(ports, requests, clients, seconds)
    after = cpu_by_role(pids)
    hist1 = [batch_histogram(p) for p in ports]
    n = max(row["requests"], 1)
    row["cpu_ms_per_request"] = {k: (after[k] - before[k]) * 1e3 / n for k in after}
    runs = sum(b["count"] - a["count"] for a, b in zip(hist0, hist1, strict=True))
    rows = sum(b["sum"] - a["sum"] for a, b in zip(hist0, hist1, strict=True))
    row["mean_rows_per_run"] = rows / runs if runs else 0.0
    return row


# The Ray setups measured against plain addnorm-serve: (replicas, CPUs each, ingress, the replicas' port range).
# Ingress: "proxy" (Ray's Python HTTP proxy), "direct" (direct ingress: the clients split across the replicas' own
# ports), "haproxy" (Ray's HAProxy mode: HAProxy on the one port, over the replicas' own ports).
RAY_SETUPS = {
    "ray": (1, None, "proxy", None),  # through Ray's HTTP proxy, one replica on every core
    "ray direct": (1, None, "direct", "30000:30099"),  # Ray's direct ingress: the replica serves HTTP itself
    # two replicas of one core each, clients split across them
    "ray direct x2": (2, 1, "direct", "30100:30199"),
    "ray haproxy": (1, None, "haproxy", "30200:30299"),  # the documented deployment: HAProxy, one port
    "ray haproxy x2": (2, 1, "haproxy", "30300:30399"),  # two replicas of one core each behind it
}
DOCUMENTED = "ray haproxy"  # the documented deployment (deploy/ray/serve.yaml): one replica behind HAProxy


def _written(path: Path, timeout_s: float = 120.0) -> list[int]:
    """The replicas' ports, once the driver has found them all answering and written them."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"the Ray driver wrote no {path} in {timeout_s:.0f} s")
        time.sleep(0.2)
    return json.loads(path.read_text())


def measure_ray(s: Setup) -> dict:
    """Plain addnorm-serve, up throughout, against each of RAY_SETUPS in turn on [8,128,E] x 1 client and [1,16,E] x
    32: each Ray setup started alone beside plain, its REPS rounds alternating with plain's (the order swapping each
    round), then stopped. One Ray instance at a time, as a machine runs it: an idle one keeps a tenth of a core busy
    (its GCS, raylet, controller and proxy), and with the other four alive at once, as this bench ran them until
    2026-12-07, plain lost a fifth of its requests/s on 2 cores and one replica behind HAProxy 0.06-0.08 of its
    ratio to plain (docs/benchmarks.md, "Ray behind HAProxy")."""
    loads = {"big": (s.x_big, 1), "small": (s.x_small, CLIENTS)}
    out: dict = {load: {"plain": []} for load in loads}
    with tempfile.TemporaryDirectory() as tmp, serve(s.artifact) as plain:
        plain_tree = {plain.proc.pid: "addnorm-serve"}
        for i, (name, (replicas, cpus, ingress, span)) in enumerate(RAY_SETUPS.items()):
            ports_file = Path(tmp) / f"{i}.json"
            with ray_server(s.artifact, replicas, cpus or s.threads, ingress, span, ports_file) as srv:
                replica_ports = _written(ports_file) if span else []  # once all its replicas answer
                ports = {"plain": [plain.port], name: replica_ports if ingress == "direct" else [srv.port]}
                trees = {"plain": plain_tree, name: process_tree(srv.proc.pid)}
                rows: dict = {load: {"plain": [], name: []} for load in loads}
                for rep in range(REPS):
                    order = ["plain", name] if rep % 2 == 0 else [name, "plain"]
                    for load, (x, clients) in loads.items():
                        for which in order:
                            rows[load][which].append(
                                phase(ports[which], x, s.name, clients, s.seconds, trees[which])
                            )
            for load in loads:
                out[load]["plain"] += rows[load]["plain"]
                out[load][name] = rows[load][name]
                pairs = zip(rows[load][name], rows[load]["plain"], strict=True)
                out[load][f"{name}_vs_plain"] = float(
                    np.median([r["throughput_rps"] / p["throughput_rps"] for r, p in pairs])
                )
    return out


def ray_table(res: dict) -> str:
    lines = [
        "| load | setup | req/s | / plain (median of 3) | CPU ms/req: proxy | replica(s) | other Ray | rows per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {"big": "[8,128,E] x 1 client", "small": f"[1,16,E] x {CLIENTS} clients"}
    med = lambda rows, f: float(np.median([f(r) for r in rows]))  # noqa: E731
    for load, label in labels.items():
        row = res[load]
        plain_cpu = med(row["plain"], lambda r: sum(r["cpu_ms_per_request"].values()))
        lines.append(
            f"| {label} | plain addnorm-serve | {med(row['plain'], lambda r: r['throughput_rps']):.1f} | 1 | "
            f"- | {plain_cpu:.2f} | - | {med(row['plain'], lambda r: r['mean_rows_per_run']):.1f} |"
        )
        for name in RAY_SETUPS:
            cpu = {
                k: med(row[name], lambda r, k=k: r["cpu_ms_per_request"][k])
                for k in ("proxy", "replica", "other")
            }
            lines.append(
                f"| {label} | {name} | {med(row[name], lambda r: r['throughput_rps']):.1f} | "
                f"{row[f'{name}_vs_plain']:.2f} | {cpu['proxy']:.2f} | {cpu['replica']:.2f} | {cpu['other']:.2f} | "
                f"{med(row[name], lambda r: r['mean_rows_per_run']):.1f} |"
            )
    return "\n".join([*lines, *goals(res)])


def goals(res: dict) -> list[str]:
    """Issue 77's goal of this section: one replica behind HAProxy against plain addnorm-serve on the small
    requests, with each one's CPU a request (all of Ray's processes for Ray's) beside it."""
    small = res.get("small", {})
    if f"{DOCUMENTED}_vs_plain" not in small:
        return []
    ratio = small[f"{DOCUMENTED}_vs_plain"]
    cpu = {
        name: float(np.median([sum(r["cpu_ms_per_request"].values()) for r in small[name]]))
        for name in ("plain", DOCUMENTED)
    }
    return section(
        [
            f"- Ray Serve, one replica behind HAProxy, {CLIENTS} clients of small requests, against plain "
            f"addnorm-serve: {ratio:.2f}x, {verdict(ratio, '>=', RAY_VS_PLAIN, 'x')} (Ray's CPU "
            f"{cpu[DOCUMENTED]:.2f} ms a request, its proxy and other processes included, against plain's "
            f"{cpu['plain']:.2f} ms)"
        ]
    )
