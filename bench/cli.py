"""addnorm-bench: throughput and latency measured side by side in one run, printed as ratios.

Sections: in-process onnxruntime (and its GEMMs alone, the practical roof), torch eager on the same weights,
the service over HTTP (V2 binary, /v1 binary, /v1 JSON), a naive FastAPI + pydantic + torch app, 32 concurrent
clients with dynamic batching on and off against the perfect-batching limit, and fp32 vs int8 vs fused.
Results go to bench/results/latest.json, two PNG plots, and the generated part of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.loadgen import build_request, run_load

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
BIG = (8, 128, 768)  # the single-request shape
SMALL = (1, 16, 768)  # the concurrent-request shape
CLIENTS = 32
TARGETS = {  # name -> (ratio key, minimum)
    "service V2 binary / in-process onnxruntime, [8,128,768]": ("v2_binary_vs_inproc", 0.9),
    "batching on / off, 32 x [1,16,768]": ("batching_on_vs_off", 2.0),
    "batching on / perfect-batching limit": ("batching_vs_perfect", 0.8),
    "/v1 JSON / naive FastAPI + pydantic + torch": ("json_vs_naive", 5.0),
    "onnxruntime / torch eager, [8,128,768]": ("ort_vs_torch", 1.8),
    "int8 / fp32, [8,128,768]": ("int8_vs_fp32", 2.0),
}


def timed(fn, seconds: float, min_runs: int = 5) -> np.ndarray:  # noqa: ANN001
    """Call ``fn`` repeatedly for about ``seconds`` (after two warm-up calls); return each call's ms."""
    fn()
    fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < min_runs:
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return np.array(times)


def stats(ms: np.ndarray, items: int = 1) -> dict:
    return {"p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)), "runs": len(ms),
            "throughput_rps": items * 1e3 / float(np.median(ms))}  # fmt: skip


def block_flops(b: int, s: int, e: int, f: int) -> tuple[float, float]:
    """(weight GEMM flops, attention flops) of one encoder layer on (b, s, e)."""
    tokens = b * s
    gemm = 2 * tokens * (e * 3 * e + e * e + e * f + f * e)
    attention = 2 * 2 * b * s * s * e  # scores and weighted sum, summed over heads
    return gemm, attention


def gemm_roof(e: int, f: int, tokens: int, threads: int, seconds: float) -> float:
    """GFLOP/s of the block's four weight GEMMs alone, in onnxruntime: the practical roof for the block."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    shapes = {"w_qkv": (e, 3 * e), "w_out": (e, e), "w_1": (e, f), "w_2": (f, e)}
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, rng.standard_normal(s).astype(np.float32).ravel())
             for n, s in shapes.items()]  # fmt: skip
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]), helper.make_node("MatMul", ["x", "w_out"], ["o"]),
             helper.make_node("MatMul", ["x", "w_1"], ["h"]), helper.make_node("MatMul", ["hin", "w_2"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "gemms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, e]),
         helper.make_tensor_value_info("hin", TensorProto.FLOAT, [tokens, f])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [tokens, d])
         for n, d in (("qkv", 3 * e), ("o", e), ("h", f), ("y", e))],
        initializer=inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feed = {"x": rng.standard_normal((tokens, e)).astype(np.float32),
            "hin": rng.standard_normal((tokens, f)).astype(np.float32)}  # fmt: skip
    ms = np.median(timed(lambda: sess.run(None, feed), seconds))
    gemm, _ = block_flops(1, tokens, e, f)
    return gemm / (ms / 1e3) / 1e9


class Server:
    """An addnorm-serve (or other uvicorn app) subprocess on a free port."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, ready_path: str = "/health/ready"
    ) -> None:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, *args, "--port", str(self.port)], cwd=ROOT,
                                     env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
        self._wait(ready_path)

    def _wait(self, ready_path: str, timeout: float = 120.0) -> None:
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}{ready_path}", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server not ready")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve(artifact: Path, *flags: str) -> Server:
    return Server(["-m", "service", "--model-dir", str(artifact), "--log-level", "warning", *flags])


def v2_request(port: int, model: str, x: np.ndarray) -> bytes:
    header = json.dumps({"inputs": [{"name": "embeddings", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    return build_request(HOST, port, f"/v2/models/{model}/infer", header + x.tobytes(),
                         {"Inference-Header-Content-Length": str(len(header))})  # fmt: skip


def v1_binary_request(port: int, x: np.ndarray) -> bytes:
    return build_request(HOST, port, "/v1/encode", x.astype("<f4").tobytes(),
                         {"Content-Type": "application/octet-stream", "X-Shape": ",".join(map(str, x.shape)),
                          "Accept": "application/octet-stream"})  # fmt: skip


def json_request(port: int, path: str, x: np.ndarray) -> bytes:
    import orjson

    body = orjson.dumps({"embeddings": x}, option=orjson.OPT_SERIALIZE_NUMPY)
    return build_request(HOST, port, path, body, {"Content-Type": "application/json"})


def run(args: argparse.Namespace) -> dict:
    import onnxruntime as ort
    import torch

    from export.weights import load_weights
    from model.artifact import Manifest
    from model.encoder import Encoder
    from service.engine import Engine, physical_cores

    artifact = Path(args.artifact)
    if not (artifact / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "export", "--out", str(artifact), "-q"], cwd=ROOT, check=True)
    manifest = Manifest.load(artifact)
    cfg = manifest.config
    if (cfg.d_model, cfg.num_layers) != (768, 1):
        print(
            f"note: artifact is {cfg.d_model} wide with {cfg.num_layers} layer(s); shapes use d_model {cfg.d_model}"
        )
    e, f = cfg.d_model, cfg.dim_feedforward
    big, small = (BIG[0], BIG[1], e), (SMALL[0], SMALL[1], e)
    rng = np.random.default_rng(0)
    x_big = rng.standard_normal(big).astype(np.float32)
    x_small = rng.standard_normal(small).astype(np.float32)
    secs = args.seconds
    threads = physical_cores()
    res: dict = {"machine": machine_info(threads), "shapes": {"big": big, "small": small, "clients": CLIENTS}}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    # 1. in-process onnxruntime (the limit) and the GEMMs alone (the roof)
    log("in-process onnxruntime ...")
    engine = Engine(artifact, "cpu")
    inproc = stats(timed(lambda: engine.run(x_big), secs))
    gemm, attn = block_flops(*big, f)
    gemm *= cfg.num_layers
    attn *= cfg.num_layers
    inproc["gflops"] = (gemm + attn) / (inproc["p50_ms"] / 1e3) / 1e9
    roof = gemm_roof(e, f, big[0] * big[1], threads, secs)
    res["inproc"] = inproc
    res["gemm_roof_gflops"] = roof
    lat_batch = {}
    for b in (1, 2, 4, 8, 16, 32):
        xb = rng.standard_normal((b, 128, e)).astype(np.float32)
        lat_batch[b] = stats(timed(lambda xb=xb: engine.run(xb), secs / 3), b)
    res["latency_vs_batch_seq128"] = lat_batch
    x32 = rng.standard_normal((CLIENTS, small[1], e)).astype(np.float32)
    perfect = stats(timed(lambda: engine.run(x32), secs), CLIENTS)
    res["perfect_batching"] = perfect
    res["unbatched_inproc"] = stats(timed(lambda: engine.run(x_small), secs))  # the ceiling without batching

    # 2. torch eager on the same weights
    log("torch eager ...")
    torch.set_num_threads(threads)
    model = load_weights(Encoder(cfg), artifact / "weights.safetensors").eval()
    xt = torch.from_numpy(x_big)
    with torch.inference_mode():
        res["torch_eager"] = stats(timed(lambda: model(xt), secs))

    # 3. the service over HTTP, one client, [8,128,768]
    log("service over HTTP ...")
    http: dict[str, dict] = {}
    with serve(artifact) as srv:
        for name, req in (("v2_binary", v2_request(srv.port, manifest.name, x_big)),
                          ("v1_binary", v1_binary_request(srv.port, x_big)),
                          ("v1_json", json_request(srv.port, "/v1/encode", x_big))):  # fmt: skip
            http[name] = run_load(HOST, srv.port, req, 1, secs).row()
    res["http_single_client"] = http

    # 4. the naive FastAPI + pydantic + torch app, same JSON body
    log("naive FastAPI + pydantic + torch ...")
    naive_env = {"ADDNORM_BENCH_ARTIFACT": str(artifact)}
    naive_cmd = ["-m", "uvicorn", "bench.naive_app:app", "--host", HOST, "--log-level", "warning"]
    with Server(naive_cmd, naive_env, ready_path="/docs") as srv:
        res["naive_json"] = run_load(HOST, srv.port, json_request(srv.port, "/encode", x_big), 1, secs,
                                     warmup=1).row()  # fmt: skip

    # 5. concurrency: 32 keep-alive clients x [1,16,768], batching on and off
    log("concurrency, batching on/off ...")
    conc: dict[str, dict] = {"on": {}, "off": {}}
    for mode, flags in (("on", ["--max-batch-size", str(CLIENTS)]), ("off", ["--max-batch-size", "1"])):
        with serve(artifact, *flags) as srv:
            req = v2_request(srv.port, manifest.name, x_small)
            for c in args.concurrency:
                before = _batch_histogram(srv.port)
                conc[mode][c] = run_load(HOST, srv.port, req, c, secs).row()
                after = _batch_histogram(srv.port)
                runs = after["count"] - before["count"]
                conc[mode][c]["mean_rows_per_run"] = (after["sum"] - before["sum"]) / runs if runs else 0.0
    res["concurrency"] = conc

    # 6. variants, in-process
    log("variants (exporting int8 and fused) ...")
    from export.variants import build_graph
    from model.encoder import Encoder as _Enc

    variants = {"fp32": inproc}
    enc = load_weights(_Enc(cfg), artifact / "weights.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        for v in ("int8", "fused"):
            path = Path(tmp) / f"{v}.onnx"
            build_graph(enc, path, v, manifest.opset)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            feed = {"embeddings": x_big, "mask": np.zeros(big[:2], bool)}
            variants[v] = stats(timed(lambda s=sess, feed=feed: s.run(None, feed), secs))
    res["variants"] = variants

    c_max = max(args.concurrency)
    res["ratios"] = {
        "v2_binary_vs_inproc": http["v2_binary"]["throughput_rps"] / inproc["throughput_rps"],
        "v1_binary_vs_inproc": http["v1_binary"]["throughput_rps"] / inproc["throughput_rps"],
        "v1_json_vs_inproc": http["v1_json"]["throughput_rps"] / inproc["throughput_rps"],
        "json_vs_naive": http["v1_json"]["throughput_rps"] / res["naive_json"]["throughput_rps"],
        "batching_on_vs_off": conc["on"][c_max]["throughput_rps"] / conc["off"][c_max]["throughput_rps"],
        "batching_vs_perfect": conc["on"][c_max]["throughput_rps"] / perfect["throughput_rps"],
        "perfect_vs_unbatched_inproc": perfect["throughput_rps"] / res["unbatched_inproc"]["throughput_rps"],
        "ort_vs_torch": inproc["throughput_rps"] / res["torch_eager"]["throughput_rps"],
        "block_vs_gemm_roof": inproc["gflops"] / roof,
        "int8_vs_fp32": variants["int8"]["throughput_rps"] / inproc["throughput_rps"],
        "fused_vs_fp32": variants["fused"]["throughput_rps"] / inproc["throughput_rps"],
    }
    return res


def _batch_histogram(port: int) -> dict[str, float]:
    """Rows per model run, from the server's own Prometheus histogram."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    out = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        if line.startswith(("addnorm_batch_size_sum", "addnorm_batch_size_count")):
            name, value = line.split()
            out[name.removeprefix("addnorm_batch_size_")] = float(value)
    return out


def machine_info(threads: int) -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime
    import torch

    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores_used": threads,
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip


def table(res: dict) -> str:
    r = res["ratios"]
    lines = ["| measurement | throughput (req/s) | p50 ms | p99 ms | rows per model run |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip

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
    lines += ["", f"Block: {res['inproc']['gflops']:.0f} GFLOP/s; its GEMMs alone: {res['gemm_roof_gflops']:.0f} GFLOP/s "
              f"(block / roof {r['block_vs_gemm_roof']:.2f}).", "",
              "| ratio (measured in this run) | value | target | met |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, (key, target) in TARGETS.items():
        lines.append(f"| {name} | {r[key]:.2f}x | >= {target}x | {'yes' if r[key] >= target else 'NO'} |")
    for key in ("v1_binary_vs_inproc", "v1_json_vs_inproc", "fused_vs_fp32", "perfect_vs_unbatched_inproc"):
        lines.append(f"| {key.replace('_', ' ')} | {r[key]:.2f}x | | |")
    big_cpu = res["http_single_client"]["v2_binary"]["client_cpu_s_per_request"] * 1e3
    c_max = max(res["concurrency"]["on"], key=int)
    small_cpu = res["concurrency"]["on"][c_max]["client_cpu_s_per_request"] * 1e3
    lines.append(f"\nLoad generator: bench/loadgen.py in its own process (asyncio, keep-alive, prebuilt requests, "
                 f"bodies read but not parsed); it used {big_cpu:.2f} ms of CPU per [{big}] V2 request and "
                 f"{small_cpu:.2f} ms per [{small}] request, on the same 2 cores as the server.")  # fmt: skip
    return "\n".join(lines)


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


MARK_BEGIN, MARK_END = "<!-- bench:begin -->", "<!-- bench:end -->"


def update_docs(doc: Path, res: dict) -> None:
    m = res["machine"]
    block = (f"{MARK_BEGIN}\nGenerated by `make bench` on {m['date']}: {m['cpu']}, {m['logical_cpus']} logical CPUs, "
             f"{m['physical_cores_used']} threads, Python {m['python']}, onnxruntime {m['onnxruntime']}, torch {m['torch']}.\n\n"
             f"{table(res)}\n\nRaw figures: `bench/results/latest.json`; plots: "
             "`bench/results/throughput_vs_concurrency.png`, `bench/results/latency_vs_batch.png`.\n"
             f"{MARK_END}")  # fmt: skip
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{MARK_BEGIN}\n{MARK_END}\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        text = head + block + rest.split(MARK_END, 1)[1]
    else:
        text += "\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="addnorm-bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--artifact", default="artifacts/default", help="artifact to benchmark (exported if missing)"
    )
    p.add_argument("--seconds", type=float, default=4.0, help="time per measurement (default 4)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, CLIENTS],
                   help=f"client counts for the concurrency curve (default 1 8 {CLIENTS}; the largest sets the ratios)")  # fmt: skip
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where JSON and PNGs go")
    p.add_argument(
        "--docs",
        type=Path,
        default=ROOT / "docs" / "benchmarks.md",
        help="doc whose generated part is rewritten",
    )
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
