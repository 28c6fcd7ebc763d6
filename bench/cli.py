"""python -m bench: throughput and latency measured side by side in one run, printed as ratios.

Sections: in-process onnxruntime (and its GEMMs alone, the practical roof), torch eager on the same weights,
the service over HTTP (V2 binary, /v1 binary, /v1 JSON), a naive FastAPI + pydantic + torch app, 32 concurrent
clients with dynamic batching on and off against the perfect-batching limit, fp32 vs int8 vs fused, and V2 over
gRPC against V2 binary over HTTP.
Results go to bench/results/latest.json, two PNG plots, and the generated part of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
import typing
from pathlib import Path

import numpy as np

from addnorm.commands import Parser, add_artifact
from addnorm.model.artifact import MANIFEST_FILE, Manifest
from bench import measure
from bench.grpc_load import grpc_table, measure_grpc
from bench.limits import limits_table, measure_limits
from bench.measure import CLIENTS, DEFAULT, Setup
from bench.report import plots, table, update_docs, write_block
from bench.server import ROOT

BIG_SHAPE = (8, 128)  # (batch, seq) of the single-request measurements
SMALL_SHAPE = (1, 16)  # (batch, seq) of each concurrent client's request


def setup(args: argparse.Namespace) -> Setup:
    """The artifact (exported if missing) and the inputs every section uses."""
    from addnorm.service.backend.cores import physical_cores

    artifact = Path(args.artifact)
    if not (artifact / MANIFEST_FILE).exists():
        subprocess.run(
            [sys.executable, "-m", "addnorm.export", "--artifact", str(artifact), "-q"], cwd=ROOT, check=True
        )
    manifest = Manifest.load(artifact)
    e = manifest.config.d_model
    if (e, manifest.config.num_layers) != (768, 1):
        print(
            f"note: artifact is {e} wide with {manifest.config.num_layers} layer(s); shapes use d_model {e}"
        )
    rng = np.random.default_rng(0)
    x_big = rng.standard_normal((*BIG_SHAPE, e)).astype(np.float32)
    x_small = rng.standard_normal((*SMALL_SHAPE, e)).astype(np.float32)
    return Setup(artifact, manifest, x_big, x_small, args.seconds, physical_cores(), args.concurrency)


def run(args: argparse.Namespace) -> dict:
    """Every section in one run, then the ratios between them."""
    s = setup(args)
    res: dict = {
        "machine": measure.machine_info(s.threads),
        "shapes": {"big": s.x_big.shape, "small": s.x_small.shape, "clients": CLIENTS},
    }
    sections = (
        ("in-process onnxruntime", lambda: res.update(measure.measure_inproc(s))),
        ("torch eager", lambda: res.update(torch_eager=measure.measure_torch(s))),
        ("service over HTTP", lambda: res.update(http_single_client=measure.measure_http(s))),
        ("naive FastAPI + pydantic + torch", lambda: res.update(naive_json=measure.measure_naive(s))),
        ("concurrency, batching on/off", lambda: res.update(concurrency=measure.measure_concurrency(s))),
        ("variants (exporting int8 and fused)", lambda: res.update(variants=measure.measure_variants(s))),
        ("gRPC vs HTTP binary", lambda: res.update(grpc=measure_grpc(s, CLIENTS))),
        (
            "the two limits, alternating",
            lambda: res.update(limits=measure_limits(s, {DEFAULT: {}}, args.rounds)),
        ),
    )
    for name, section in sections:
        print(f"{name} ...", file=sys.stderr, flush=True)
        section()
    res["variants"] = {"fp32": res["inproc"], **res["variants"]}
    res["ratios"] = measure.ratios(res)
    return res


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    add_artifact(p, "artifact to benchmark (exported if missing)")
    p.add_argument("--seconds", type=float, default=4.0, help="time per measurement")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, CLIENTS],
        help=f"client counts for the concurrency curve (default 1 8 {CLIENTS}; the largest sets the ratios)",
    )
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where JSON and PNGs go")
    p.add_argument(
        "--docs",
        type=Path,
        default=ROOT / "docs" / "benchmarks.md",
        help="the doc whose block for this run (make bench's ratios, or the section's) is rewritten",
    )
    r = p.add_argument_group("reliability (instead of the ratios)")
    r.add_argument(
        "--soak",
        type=float,
        metavar="SECONDS",
        help="64 keep-alive clients mixing valid, invalid, oversized and hang-up requests for SECONDS; "
        "prints status counts, latency, memory and file descriptors",
    )
    r.add_argument(
        "--burst",
        type=int,
        metavar="N",
        help="resident memory before, at the peak of and after N concurrent [1, 4096, d_model] requests",
    )
    r.add_argument("--clients", type=int, default=64, help="clients for --soak (default 64)")
    r.add_argument(
        "--stall",
        action="store_true",
        help="with --artifact DIR of a text model: 10 MB strings, 10 MB V2 BYTES elements (HTTP, gRPC), a 70 MB "
        "body and the largest accepted text requests, each while another client probes; prints each one's answer, "
        "the probe's slowest answers and the memory 10 s after",
    )
    p.add_argument(
        "--cost-curve",
        action="store_true",
        help="instead of the ratios: time and peak memory of [1,S,E] (S 16..8192) and [B,128,E] runs for the mha "
        "and decomposed attention forms and torch eager, each point in its own process; writes "
        "bench/results/cost_curve.json and cost_curve.png",
    )
    p.add_argument(
        "--perf-analyzer",
        action="store_true",
        help="instead of the ratios: NVIDIA's perf_analyzer (fetched on first use: bench/perf_analyzer.py) "
        "against addnorm-serve over HTTP and gRPC, beside bench.loadgen on the same requests; writes "
        "bench/results/perf_analyzer.json",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="instead of the ratios: Ray Serve (1 replica) against plain addnorm-serve, phases interleaved, "
        "with CPU per request by process (needs the 'ray' extra); writes bench/results/ray.json",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help="instead of the ratios: only the two limits (V2 binary [8,128,E] vs in-process, 32 clients' batching "
        "vs the perfect-batching limit), alternating with in-process, median of --rounds (also part of the full run)",
    )
    p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --limits: also measure a server with these ADDNORM_* settings, alternating with the default one",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of the alternating sections (default 3)")
    p.add_argument(
        "--grpc",
        action="store_true",
        help="instead of the ratios: only V2 over gRPC (a call per request, and a stream per client) against V2 binary over HTTP (also part of the full run)",
    )
    p.add_argument(
        "--models",
        action="store_true",
        help="instead of the ratios: two models sharing the cores against one alone, under three thread "
        "policies (bench/models.py)",
    )
    p.add_argument(
        "--lengths",
        choices=["real"],
        help="instead of the ratios: requests of mixed lengths drawn like real text (bench/mixed.py), 1, 8 and 32 "
        "clients over V2 binary, gRPC and a gRPC stream, each --merge-lengths policy and the artifact's packed twin (exported "
        "beside it with --packed), against the unpadded limit; writes bench/results/mixed.json",
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="instead of the ratios: every variant of a real trained checkpoint (all-MiniLM-L6-v2, from the dev "
        "extra) against transformers on real sentences: gate verdict, error, sentence cosine, ranking, speed "
        "(bench/real.py)",
    )
    p.add_argument(
        "--text",
        action="store_true",
        help="instead of the ratios: text to vectors (bench/text.py): real sentences through all-MiniLM-L6-v2's "
        "/v1/embeddings at 1, 8 and 32 clients, 1 and 8 sentences a request, against the in-process limit, a FastAPI "
        "app calling sentence-transformers (torch, and ONNX batched) and Infinity (torch and ONNX engines), the peers where `make peers` made their environment; writes text.json in --results",
    )
    p.add_argument(
        "--rerank",
        action="store_true",
        help="instead of the ratios: one query against 100 documents of real text (bench/rerank.py) on a cross-encoder "
        "(all-MiniLM-L6-v2's encoder with a head) at 1, 8 and 32 clients, against the in-process limit, a FastAPI app "
        "calling sentence-transformers' CrossEncoder and Infinity (where installed); writes rerank.json in --results",
    )
    return p


def limits_only(args: argparse.Namespace) -> int:
    """--limits: the two limits alone (and --against settings beside the defaults), printed."""
    s = setup(args)
    configs = {DEFAULT: {}}
    if args.against:
        configs["against"] = dict(kv.split("=", 1) for kv in args.against)
    res = measure_limits(s, configs, args.rounds)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "limits.json").write_text(json.dumps(res, indent=2) + "\n")
    big, small = ("x".join(map(str, x.shape)) for x in (s.x_big, s.x_small))
    print("\n".join(limits_table(res, big, small)))
    return 0


def grpc_only(args: argparse.Namespace) -> int:
    """--grpc: the transport comparison alone, printed."""
    s = setup(args)
    res = measure_grpc(s, CLIENTS)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "grpc.json").write_text(json.dumps(res, indent=2) + "\n")
    big, small = ("x".join(map(str, x.shape)) for x in (s.x_big, s.x_small))
    print("\n".join(grpc_table(res, big, small, CLIENTS)))
    return 0


def models_only(args: argparse.Namespace) -> int:
    """--models: two models sharing the cores, printed and kept beside the other results."""
    from bench.models import measure_models, models_table

    s = setup(args)
    res = {"machine": measure.machine_info(s.threads), "models": measure_models(s, CLIENTS)}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "models.json").write_text(json.dumps(res, indent=2) + "\n")
    big, small = ("x".join(map(str, x.shape)) for x in (s.x_big, s.x_small))
    print("\n".join(models_table(res["models"], big, small, CLIENTS)))
    return 0


def mixed_lengths(args: argparse.Namespace) -> int:
    """--lengths real: the mixed-length table, printed and kept beside the other results."""
    from bench import mixed

    s = setup(args)
    res = {
        "machine": measure.machine_info(s.threads),
        **mixed.measure(s, args.rounds, tuple(args.concurrency)),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "mixed.json").write_text(json.dumps(res, indent=2) + "\n")
    print(mixed.table(res))
    return 0


def reliability(args: argparse.Namespace) -> int:
    """--soak / --burst: print the figures as JSON; exit 1 when the soak saw a 5xx or a wrong answer."""
    from bench import reliability as rel

    if args.stall:
        from bench import stall

        result = stall.stall(Path(args.artifact))
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "stall.json").write_text(json.dumps(result, indent=2) + "\n")
        print(stall.table(result))
        return 0
    artifact = setup(args).artifact
    if args.burst:
        print(json.dumps(rel.burst(artifact, args.burst), indent=2))
        return 0
    summary = rel.soak(artifact, args.soak, args.clients).summary()
    print(json.dumps(summary, indent=2))
    return 1 if summary["5xx"] or summary["wrong_answers"] or summary["unexpected"] else 0


def cost_curve(args: argparse.Namespace) -> int:
    """--cost-curve: print the curve's tables, keep its figures and plot beside the others."""
    from bench import cost, long

    s = setup(args)
    args.results.mkdir(parents=True, exist_ok=True)
    artifacts = cost.curve_artifacts(s.artifact, args.results / "cost_artifacts")
    res = {"machine": measure.machine_info(s.threads)}
    res["curve"] = cost.curve(artifacts, s.threads)
    res["headline"] = cost.headline(artifacts, s.threads)
    res["long"] = long.longest(s.threads)  # ModernBERT's shape at 8,192 tokens, against sentence-transformers
    (args.results / "cost_curve.json").write_text(json.dumps(res, indent=2) + "\n")
    cost.plot_curve(res, args.results)
    print(cost.curve_table(res))
    return 0


def scale_out(args: argparse.Namespace) -> int:
    """--ray: print the Ray Serve table and keep its figures beside the others."""
    from bench.scaleout import measure_ray, ray_table

    res = measure_ray(setup(args))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "ray.json").write_text(json.dumps(res, indent=2) + "\n")
    print(ray_table(res))
    return 0


def perf_analyzer(args: argparse.Namespace) -> int:
    """--perf-analyzer: print its table and keep its figures beside the others."""
    from bench import perf_analyzer as pa

    try:
        res = pa.measure(setup(args).artifact)
    except pa.Unavailable as exc:
        print(f"perf_analyzer is not available here: {exc}", file=sys.stderr)
        return 1
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "perf_analyzer.json").write_text(json.dumps(res, indent=2) + "\n")
    print(pa.table(res))
    return 0


class _Tee(io.TextIOBase):
    """stdout, and a copy of what a section prints for docs/benchmarks.md."""

    def __init__(self, *streams: typing.TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def section(args: argparse.Namespace, argv: list[str], name: str, run: typing.Callable[[], int]) -> int:
    """Run one section (``--limits``, ``--text``, ...) as it prints its table, and once it succeeds put what it
    printed in its block of docs/benchmarks.md (``--docs``), under the command, the date and the CPU's flags."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        code = run()
    if code == 0 and printed.getvalue().strip():
        write_block(args.docs, name, " ".join(["python -m bench", *argv]), printed.getvalue())
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.soak or args.burst or args.stall:  # the reliability figures: docs/reliability.md
        return reliability(args)
    sections = {  # the first flag given decides; each writes its own block of the doc
        "perf_analyzer": lambda: perf_analyzer(args),
        "ray": lambda: scale_out(args),
        "cost_curve": lambda: cost_curve(args),
        "grpc": lambda: grpc_only(args),
        "models": lambda: models_only(args),
        "limits": lambda: limits_only(args),
        "lengths": lambda: mixed_lengths(args),
        "real": lambda: _real(args),
        "text": lambda: _text(args),
        "rerank": lambda: _rerank(args),
    }
    for name, run_section in sections.items():
        if getattr(args, name):
            return section(args, argv, name, run_section)
    start = time.perf_counter()
    res = run(args)
    res["bench_seconds"] = time.perf_counter() - start
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "latest.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    plots(res, args.results)
    update_docs(args.docs, res)
    print(table(res))
    print(f"\n({res['bench_seconds']:.0f} s; wrote {args.results}/latest.json, PNGs, and {args.docs})")
    return 0


def _real(args: argparse.Namespace) -> int:
    from bench import real

    return real.main(args.rounds)


def _text(args: argparse.Namespace) -> int:
    from bench import text

    return text.main(
        ["--rounds", str(args.rounds), "--seconds", str(args.seconds), "--results", str(args.results)]
    )


def _rerank(args: argparse.Namespace) -> int:
    from bench import rerank

    return rerank.main(
        ["--rounds", str(args.rounds), "--seconds", str(args.seconds), "--results", str(args.results)]
    )


if __name__ == "__main__":
    sys.exit(main())
