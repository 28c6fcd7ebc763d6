"""How python -m bench's results read: the markdown table of figures and ratios, two plots, docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

TARGETS = {  # name -> (ratio key, minimum)
    "service V2 binary / in-process onnxruntime, [8,128,768]": ("v2_binary_vs_inproc", 0.9),
    "batching on / off, 32 x [1,16,768]": ("batching_on_vs_off", 2.0),
    "batching on / perfect-batching limit": ("batching_vs_perfect", 0.8),
    "/v1 JSON / naive FastAPI + pydantic + torch": ("json_vs_naive", 5.0),
    "onnxruntime / torch eager, [8,128,768]": ("ort_vs_torch", 1.8),
    "int8 / fp32, [8,128,768]": ("int8_vs_fp32", 2.0),
}


def table(res: dict) -> str:
    r = res["ratios"]
    lines = [
        "| measurement | throughput (req/s) | p50 ms | p99 ms | rows per model run |",
        "| --- | --- | --- | --- | --- |",
    ]

    def add(name: str, row: dict) -> None:
        rows = f"{row['mean_rows_per_run']:.1f}" if "mean_rows_per_run" in row else ""
        lines.append(
            f"| {name} | {row['throughput_rps']:.2f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {rows} |"
        )

    big = "x".join(map(str, res["shapes"]["big"]))
    add(f"in-process onnxruntime [{big}]", res["inproc"])
    add(f"torch eager [{big}]", res["torch_eager"])
    for name, row in res["http_single_client"].items():
        add(f"service {name.replace('_', ' ')} [{big}], 1 client", row)
    add(f"naive FastAPI+pydantic+torch JSON [{big}]", res["naive_json"])
    small = "x".join(map(str, res["shapes"]["small"]))
    for mode in ("on", "off"):
        for c, row in res["concurrency"][mode].items():
            add(f"service V2 binary, {c} clients x [{small}], batching {mode}", row)
    add(
        f"perfect batching limit (in-process batch {res['shapes']['clients']}, per request)",
        res["perfect_batching"],
    )
    add(f"unbatched in-process limit (in-process [{small}], one at a time)", res["unbatched_inproc"])
    for v, row in res["variants"].items():
        add(f"in-process {v} [{big}]", row)
    lines += [
        "",
        f"Block: {res['inproc']['gflops']:.0f} GFLOP/s; its GEMMs alone: {res['gemm_roof_gflops']:.0f} GFLOP/s "
        f"(block / roof {r['block_vs_gemm_roof']:.2f}).",
        "",
        "| ratio (measured in this run) | value | target | met |",
        "| --- | --- | --- | --- |",
    ]
    for name, (key, target) in TARGETS.items():
        lines.append(f"| {name} | {r[key]:.2f}x | >= {target}x | {'yes' if r[key] >= target else 'NO'} |")
    for key in ("v1_binary_vs_inproc", "v1_json_vs_inproc", "fused_vs_fp32", "perfect_vs_unbatched_inproc"):
        lines.append(f"| {key.replace('_', ' ')} | {r[key]:.2f}x | | |")
    if "limits" in res:
        from bench.limits import limits_table

        n = len(res["limits"]["rounds"])
        lines += [
            "",
            f"The first and third targets are the median of {n} rounds in which in-process and the server alternate "
            "(bench/limits.py); the other figures above are one pass each.",
            "",
            *limits_table(res["limits"], big, small),
        ]
    lines += cpu_table(res)
    if "grpc" in res:
        from bench.grpc_load import grpc_table

        lines += grpc_table(res["grpc"], big, small, res["shapes"]["clients"])
    big_cpu = res["http_single_client"]["v2_binary"]["client_cpu_s_per_request"] * 1e3
    c_max = max(res["concurrency"]["on"], key=int)
    small_cpu = res["concurrency"]["on"][c_max]["client_cpu_s_per_request"] * 1e3
    lines.append(
        f"\nLoad generator: bench/loadgen.py in its own process (asyncio, keep-alive, prebuilt requests, "
        f"bodies read but not parsed); it used {big_cpu:.2f} ms of CPU per [{big}] V2 request and "
        f"{small_cpu:.2f} ms per [{small}] request, on the same 2 cores as the server."
    )
    return "\n".join(lines)


def cpu_table(res: dict) -> list[str]:
    """The server's CPU per request from the OS: the whole process, its event-loop thread (where the request path
    runs), and inference alone in-process at the same batch size for comparison. total - inference is not a
    reliable request-path figure (it came out negative with batching on: in-process and in-server inference cost
    differ); the event-loop thread's CPU is the direct one. Both are printed."""
    inf = res["inference_cpu_ms"]
    big, small = ("x".join(map(str, res["shapes"][k])) for k in ("big", "small"))
    lines = [
        "",
        "| CPU per request (server process, from the OS) | total ms | event-loop thread ms "
        "| inference alone, in-process, same batch ms | total - inference ms |",
        "| --- | --- | --- | --- | --- |",
    ]

    def add(name: str, row: dict, inference: float) -> None:
        lines.append(
            f"| {name} | {row['server_cpu_ms_per_request']:.2f} | {row['loop_cpu_ms_per_request']:.2f} "
            f"| {inference:.2f} | {row['server_cpu_ms_per_request'] - inference:.2f} |"
        )

    for name, row in res["http_single_client"].items():
        add(f"{name.replace('_', ' ')} [{big}], 1 client", row, inf["big"])
    for mode in ("on", "off"):  # inference alone at the batch size the server ran (rows per model run)
        for c, row in res["concurrency"][mode].items():
            add(f"V2 binary, {c} clients x [{small}], batching {mode}", row, row["inference_cpu_ms"])
    return lines


def plots(res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out / "throughput_vs_concurrency.png", out / "latency_vs_batch.png"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in ("on", "off"):
        pts = sorted((int(c), row["throughput_rps"]) for c, row in res["concurrency"][mode].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batching {mode}")
    ax.axhline(
        res["perfect_batching"]["throughput_rps"], ls="--", color="gray", label="perfect batching limit"
    )
    ax.set_xlabel("concurrent keep-alive clients")
    ax.set_ylabel("requests / s")
    ax.set_title("Throughput vs concurrency, V2 binary [1,16,768]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    pts = sorted((int(b), row["p50_ms"]) for b, row in res["latency_vs_batch_seq128"].items())
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (seq 128)")
    ax.set_ylabel("p50 latency, ms (in-process onnxruntime)")
    ax.set_title("Latency vs batch size")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def marks(name: str) -> tuple[str, str]:
    """The comments that hold docs/benchmarks.md's block ``name``, which that section's command rewrites."""
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def machine_line(command: str) -> str:
    """What a generated table was measured with: the command, the date, the CPU and its SIMD flags, the runtime."""
    import datetime as dt
    import platform

    import onnxruntime

    from addnorm.model.runtime import cpu_flags
    from bench.measure import cpu_model

    cpu = cpu_model()
    flags = " ".join(sorted(cpu_flags())) or "none of avx2/avx512/vnni/amx"
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Generated by `{command}` on {date}: {cpu}, {os.cpu_count()} logical CPUs, CPU flags `{flags}`, "
        f"Python {platform.python_version()}, onnxruntime {onnxruntime.__version__}."
    )


def write_block(doc: Path, name: str, command: str, body: str) -> None:
    """Replace docs/benchmarks.md's block ``name`` with ``body`` (markdown, or printed text, which goes in a code
    block) under a line naming the command, date and machine; a doc without the block gets it at its end."""
    begin, end = marks(name)
    if not body.lstrip().startswith("|"):
        body = f"```text\n{body.strip()}\n```"
    block = f"{begin}\n{machine_line(command)}\n\n{body.strip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def update_docs(doc: Path, res: dict) -> None:
    """make bench's ratios: the table and where the raw figures and plots are."""
    m = res["machine"]
    body = (
        f"{table(res)}\n\n{m['physical_cores_used']} threads, torch {m['torch']}. Raw figures: "
        "`bench/results/latest.json`; plots: `bench/results/throughput_vs_concurrency.png`, "
        "`bench/results/latency_vs_batch.png`."
    )
    write_block(doc, "ratios", "make bench", body)


def artifact_given(parser: argparse.ArgumentParser, artifact: Path) -> None:
    """A bench's usage error when ``artifact`` holds no exported artifact."""
    if not (artifact / "manifest.json").exists():
        parser.error(f"{artifact} holds no artifact: export one (addnorm-export --artifact {artifact})")


def save(res: dict, results: Path, name: str) -> None:
    """A bench's figures as ``results/name`` (JSON; the directory made when missing)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / name).write_text(json.dumps(res, indent=2) + "\n")
