"""A Ray Serve instance on loopback for ``python -m bench --ray``: a local Ray, Serve's proxy on ``--port``, the
addnorm app (service/ray_serve.py) with N replicas. Stops Serve and Ray on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import threading

import ray
from ray import serve

from bench.server import HOST
from service.ray_serve import build


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ray_driver", description=__doc__)
    p.add_argument("--artifact", required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=1, help="CPUs (and onnxruntime threads) per replica")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cpus = max(args.replicas * args.num_cpus, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address=HOST, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": args.port})
        app = build({"model_dir": args.artifact, "replicas": args.replicas, "num_cpus": args.num_cpus})
        serve.run(app, name="addnorm", route_prefix="/")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
