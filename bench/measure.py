"""The measurements of python -m bench, each a function of its own. Ratios are taken only between figures measured
in the same run (bench.cli), never against a stored number.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from addnorm.model.artifact import WEIGHTS_FILE, Manifest
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
from addnorm.model.runtime import CPU, session_args
from bench.loadgen import build_request, run_load
from bench.server import HOST, ServerProcess, serve

CLIENTS = 32
DEFAULT = "defaults"  # bench.limits' label for the server with default settings


@dataclass
class Setup:
    """What every measurement shares: the artifact, its inputs, the time per measurement, the threads."""

    artifact: Path
    manifest: Manifest
    x_big: np.ndarray  # (8, 128, E): the single-request shape
    x_small: np.ndarray  # (1, 16, E): the concurrent-request shape
    seconds: float
    threads: int
    concurrency: list[int]

    @property
    def name(self) -> str:
        return self.manifest.name


def timed(fn, seconds: float, min_runs: int = 5) -> np.ndarray:
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


def limit_engines(artifact: Path) -> list:
    """The engines an in-process limit runs on, one a way the server runs its batches: one run at a time on every
    thread and, where the model has more than one thread, one run a thread side by side (``--parallel-runs on``,
    the server's way under load; ``Engine.lanes`` runs at once). A limit is the faster of them."""
    from addnorm.service.backend.engine import Engine

    engines = [Engine(artifact, "cpu")]
    if (side := Engine(artifact, "cpu", parallel_runs=True)).lanes > 1:
        engines.append(side)
    return engines


def stats(ms: np.ndarray, items: int = 1) -> dict:
    return {
        "p50_ms": float(np.median(ms)),
        "p99_ms": float(np.percentile(ms, 99)),
        "runs": len(ms),
        "throughput_rps": items * 1e3 / float(np.median(ms)),
    }


def block_flops(b: int, s: int, e: int, f: int) -> tuple[float, float]:
    """(weight GEMM flops, attention flops) of one encoder layer on (b, s, e)."""
    tokens = b * s
    gemm = 2 * tokens * (e * 3 * e + e * e + e * f + f * e)
    attention = 2 * 2 * b * s * s * e  # scores and weighted sum, summed over heads
    return gemm, attention


def process_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU time (user + system) the OS has charged to a process, or to one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()  # after the command name: field 3 is index 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_with_cpu(srv, request: bytes, clients: int, seconds: float, load=None) -> dict:
    """run_load (or ``load(request, clients, seconds)``, another transport's), plus the server's CPU per request:
    the whole process and its event-loop (main) thread."""
    pid = srv.proc.pid
    total0, loop0 = process_cpu_s(pid), process_cpu_s(pid, pid)
    if load is None:
        row = run_load(HOST, srv.port, request, clients, seconds).row()
    else:
        row = load(request, clients, seconds).row()
    total1, loop1 = process_cpu_s(pid), process_cpu_s(pid, pid)
    n = max(row["requests"], 1)
    row["server_cpu_ms_per_request"] = (total1 - total0) * 1e3 / n
    row["loop_cpu_ms_per_request"] = (loop1 - loop0) * 1e3 / n
    return row


def cpu_ms_per_item(fn, seconds: float, items: int) -> float:
    """In-process CPU (all threads) per item of ``fn``'s work, over about ``seconds`` of calls."""
    fn()
    cpu0, calls, end = time.process_time(), 0, time.perf_counter() + seconds
    while time.perf_counter() < end or calls < 3:
        fn()
        calls += 1
    return (time.process_time() - cpu0) * 1e3 / (calls * items)


def gemm_graph(e: int, f: int, tokens: int):
    """The block's four weight GEMMs alone, as an ONNX graph: (model, feed, weights by name)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    shapes = {"w_qkv": (e, 3 * e), "w_out": (e, e), "w_1": (e, f), "w_2": (f, e)}
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    inits = [helper.make_tensor(n, TensorProto.FLOAT, w.shape, w.ravel()) for n, w in weights.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]),
        helper.make_node("MatMul", ["x", "w_out"], ["o"]),
        helper.make_node("MatMul", ["x", "w_1"], ["h"]),
        helper.make_node("MatMul", ["hin", "w_2"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, e]),
        helper.make_tensor_value_info("hin", TensorProto.FLOAT, [tokens, f]),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [tokens, d])
        for n, d in (("qkv", 3 * e), ("o", e), ("h", f), ("y", e))
    ]
    graph = helper.make_graph(nodes, "gemms", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    feed = {
        "x": rng.standard_normal((tokens, e)).astype(np.float32),
        "hin": rng.standard_normal((tokens, f)).astype(np.float32),
    }
    return model, feed, weights


def gemm_roof(e: int, f: int, tokens: int, threads: int, seconds: float) -> float:
    """GFLOP/s of the block's four weight GEMMs alone, in onnxruntime: the practical roof for the block."""
    import onnxruntime as ort

    model, feed, _ = gemm_graph(e, f, tokens)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ms = np.median(timed(lambda: sess.run(None, feed), seconds))
    gemm, _ = block_flops(1, tokens, e, f)
    return gemm / (ms / 1e3) / 1e9


def v2_request(port: int, model: str, x: np.ndarray, mask: np.ndarray | None = None) -> bytes:
    """A V2 binary request: the embeddings, and the mask if given (BOOL, a byte each), as binary data."""
    tensors = [(EMBEDDINGS, x, "FP32")] + ([] if mask is None else [(MASK, mask, "BOOL")])
    inputs = [
        {"name": name, "shape": list(a.shape), "datatype": kind, "parameters": {"binary_data_size": a.nbytes}}
        for name, a, kind in tensors
    ]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return build_request(
        HOST,
        port,
        f"/v2/models/{model}/infer",
        header + b"".join(a.tobytes() for _, a, _ in tensors),
        {"Inference-Header-Content-Length": str(len(header))},
    )


def v1_binary_request(port: int, x: np.ndarray) -> bytes:
    return build_request(
        HOST,
        port,
        "/v1/encode",
        x.astype("<f4").tobytes(),
        {
            "Content-Type": "application/octet-stream",
            "X-Shape": ",".join(map(str, x.shape)),
            "Accept": "application/octet-stream",
        },
    )


def json_request(port: int, path: str, x: np.ndarray) -> bytes:
    import orjson

    body = orjson.dumps({EMBEDDINGS: x}, option=orjson.OPT_SERIALIZE_NUMPY)
    return build_request(HOST, port, path, body, {"Content-Type": "application/json"})


def measure_inproc(s: Setup) -> dict:
    """In-process onnxruntime (the limit), the GEMM roof, latency against batch size, perfect batching. One request
    at a time spins within its run, as the server's run of a lone request does at its defaults (``--intra-op-spinning
    light``); perfect batching, the limit of a loaded server, whose runs sleep between sections, does not."""
    from addnorm.service.backend.engine import Engine

    cfg = s.manifest.config
    engine = Engine(s.artifact, "cpu", spinning="in-run")
    loaded = Engine(s.artifact, "cpu")
    inproc = stats(timed(lambda: engine.run(s.x_big), s.seconds))
    gemm, attn = block_flops(*s.x_big.shape, cfg.dim_feedforward)
    inproc["gflops"] = (gemm + attn) * cfg.num_layers / (inproc["p50_ms"] / 1e3) / 1e9
    rng = np.random.default_rng(0)
    lat_batch = {}
    for b in (1, 2, 4, 8, 16, 32):
        xb = rng.standard_normal((b, 128, cfg.d_model)).astype(np.float32)
        lat_batch[b] = stats(timed(lambda xb=xb: engine.run(xb), s.seconds / 3), b)
    x32 = rng.standard_normal((CLIENTS, s.x_small.shape[1], cfg.d_model)).astype(np.float32)
    tokens = s.x_big.shape[0] * s.x_big.shape[1]
    return {
        "inproc": inproc,
        "gemm_roof_gflops": gemm_roof(cfg.d_model, cfg.dim_feedforward, tokens, s.threads, s.seconds),
        "latency_vs_batch_seq128": lat_batch,
        "perfect_batching": stats(timed(lambda: loaded.run(x32), s.seconds), CLIENTS),
        # no batching: its ceiling
        "unbatched_inproc": stats(timed(lambda: engine.run(s.x_small), s.seconds)),
        # Inference alone, CPU per request, to subtract from the server's: what the request path itself costs.
        "inference_cpu_ms": {"big": cpu_ms_per_item(lambda: engine.run(s.x_big), s.seconds / 2, 1)},
    }


def measure_torch(s: Setup) -> dict:
    """torch eager on the same weights."""
    import torch

    from addnorm.export.weights import load_weights
    from addnorm.model.encoder import Encoder

    torch.set_num_threads(s.threads)
    model = load_weights(Encoder(s.manifest.config), s.artifact / WEIGHTS_FILE).eval()
    xt = torch.from_numpy(s.x_big)
    with torch.inference_mode():
        return stats(timed(lambda: model(xt), s.seconds))


def measure_http(s: Setup) -> dict:
    """The service over HTTP, one client, the big shape, in each protocol and encoding."""
    out = {}
    with serve(s.artifact) as srv:
        for name, req in (
            ("v2_binary", v2_request(srv.port, s.name, s.x_big)),
            ("v1_binary", v1_binary_request(srv.port, s.x_big)),
            ("v1_json", json_request(srv.port, "/v1/encode", s.x_big)),
        ):
            out[name] = load_with_cpu(srv, req, 1, s.seconds)
    return out


def measure_naive(s: Setup) -> dict:
    """The naive FastAPI + pydantic + torch app, same JSON body."""
    env = {"ADDNORM_BENCH_ARTIFACT": str(s.artifact)}
    cmd = ["-m", "uvicorn", "bench.naive_app:app", "--host", HOST, "--log-level", "warning"]
    with ServerProcess(cmd, env, ready_path="/docs", capture=False) as srv:
        req = json_request(srv.port, "/encode", s.x_big)
        return run_load(HOST, srv.port, req, 1, s.seconds, warmup=1).row()


def measure_concurrency(s: Setup) -> dict:
    """Keep-alive clients x the small shape, batching on and off, with rows per model run from /metrics, and the
    CPU per request that inference alone takes in-process at the batch size the server actually ran."""
    from addnorm.service.backend.engine import Engine

    engine = Engine(s.artifact, "cpu")
    conc: dict[str, dict] = {"on": {}, "off": {}}
    for mode, flags in (("on", ["--max-batch-size", str(CLIENTS)]), ("off", ["--max-batch-size", "1"])):
        with serve(s.artifact, *flags) as srv:
            req = v2_request(srv.port, s.name, s.x_small)
            for c in s.concurrency:
                before = batch_histogram(srv.port)
                conc[mode][c] = load_with_cpu(srv, req, c, s.seconds)
                after = batch_histogram(srv.port)
                runs = after["count"] - before["count"]
                rows = (after["sum"] - before["sum"]) / runs if runs else 0.0
                conc[mode][c]["mean_rows_per_run"] = rows
                xb = np.repeat(s.x_small, max(1, round(rows)), axis=0)
                conc[mode][c]["inference_cpu_ms"] = cpu_ms_per_item(
                    lambda xb=xb: engine.run(xb), 1.0, len(xb)
                )
    return conc


def measure_variants(s: Setup) -> dict:
    """int8 and fused graphs of the same weights, in-process, the big shape."""
    import onnxruntime as ort

    from addnorm.export.variants import build_graph
    from addnorm.export.weights import load_weights
    from addnorm.model.encoder import Encoder

    out = {}
    encoder = load_weights(Encoder(s.manifest.config), s.artifact / WEIGHTS_FILE)
    feed = {EMBEDDINGS: s.x_big, MASK: np.zeros(s.x_big.shape[:2], bool)}
    with tempfile.TemporaryDirectory() as tmp:
        for v in ("int8", "fused"):
            path = Path(tmp) / f"{v}.onnx"
            build_graph(encoder, path, v, s.manifest.opset)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = s.threads
            sess = ort.InferenceSession(
                str(path),
                opts,
                **session_args([CPU]),
            )
            out[v] = stats(timed(lambda sess=sess: sess.run([ENCODED], feed), s.seconds))
    return out


def ratios(res: dict) -> dict[str, float]:
    """Every ratio the report prints, from figures of this run."""
    inproc, http, conc = res["inproc"]["throughput_rps"], res["http_single_client"], res["concurrency"]
    c_max = max(conc["on"], key=int)
    rps = lambda row: row["throughput_rps"]  # noqa: E731
    # The two limits the service is held to come from bench.limits (alternating, median of rounds) when it ran.
    limits = res.get("limits", {}).get("servers", {}).get(DEFAULT, {}).get("median", {})
    return {
        "v2_binary_vs_inproc": limits.get("v2_binary_vs_inproc", rps(http["v2_binary"]) / inproc),
        "v1_binary_vs_inproc": rps(http["v1_binary"]) / inproc,
        "v1_json_vs_inproc": rps(http["v1_json"]) / inproc,
        "json_vs_naive": rps(http["v1_json"]) / rps(res["naive_json"]),
        "batching_on_vs_off": rps(conc["on"][c_max]) / rps(conc["off"][c_max]),
        "batching_vs_perfect": limits.get(
            "batching_vs_perfect", rps(conc["on"][c_max]) / rps(res["perfect_batching"])
        ),
        "perfect_vs_unbatched_inproc": rps(res["perfect_batching"]) / rps(res["unbatched_inproc"]),
        "ort_vs_torch": inproc / rps(res["torch_eager"]),
        "block_vs_gemm_roof": res["inproc"]["gflops"] / res["gemm_roof_gflops"],
        "int8_vs_fp32": rps(res["variants"]["int8"]) / inproc,
        "fused_vs_fp32": rps(res["variants"]["fused"]) / inproc,
    }


def batch_histogram(port: int) -> dict[str, float]:
    """Rows per model run, from the server's own Prometheus histogram (every model's series added)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    out = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        if line.startswith(("addnorm_batch_size_sum", "addnorm_batch_size_count")):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("addnorm_batch_size_")] += float(value)
    return out


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("unknown" where it cannot be read)."""
    with contextlib.suppress(OSError, StopIteration):
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return "unknown"


def machine_info(threads: int) -> dict:
    cpu = cpu_model()
    import onnxruntime
    import torch

    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "physical_cores_used": threads,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
