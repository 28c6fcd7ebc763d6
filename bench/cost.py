"""The cost curve: time and peak resident memory of one [B, S, E] run, against S and against B.

Each point runs in a process of its own (``python -m bench.cost POINT``), so its peak resident memory (the OS's
``ru_maxrss``) is that point's alone. Implementations: ``ort:DIR`` (the artifact in DIR through the serving
``Engine``), and ``torch`` (torch eager ``nn.TransformerEncoderLayer`` on the same weights, the best of its fast
path on and off). The exponent of time against S is fitted over the long end, where attention dominates.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.server import ROOT

SEQS = (16, 64, 256, 1024, 2048, 4096, 8192)
BATCHES = (1, 4, 16, 64)
BATCH_SEQ = 128
MEMORY_CAP_GB = 16.0  # a point whose predicted peak exceeds this is skipped ("as far as memory allows")


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _ort(artifact: Path, x: np.ndarray, threads: int, repeats: int, device: str) -> float:
    from service.engine import Engine

    engine = Engine(artifact, device, threads)
    return _time(lambda: engine.run(x), repeats)


def _torch(artifact: Path, x: np.ndarray, threads: int, repeats: int, device: str) -> float:
    import torch
    from torch import nn

    from export.weights import read_state_dict
    from model.artifact import WEIGHTS_FILE, Manifest

    cfg = Manifest.load(artifact).config
    torch.set_num_threads(threads)
    layer = nn.TransformerEncoderLayer(
        cfg.d_model,
        cfg.nhead,
        cfg.dim_feedforward,
        0.0,
        cfg.activation,
        cfg.layer_norm_eps,
        True,
        cfg.norm_first,
    )
    state = {k.removeprefix("layers.0."): v for k, v in read_state_dict(artifact / WEIGHTS_FILE).items()}
    layer.load_state_dict(state)
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    layer.eval().to(dev)
    xt = torch.from_numpy(x).to(dev)

    def call() -> None:
        layer(xt).cpu()  # the result back on the host, as the onnxruntime engine returns it

    best = float("inf")
    with torch.inference_mode():
        for fast in (True, False):  # nn.MultiheadAttention's fused fast path, and the plain one
            torch.backends.mha.set_fastpath_enabled(fast)
            best = min(best, _time(call, repeats))
    return best


def run_point(impl: str, batch: int, seq: int, threads: int, repeats: int, device: str = "cpu") -> dict:
    """One point, in this process: seconds per run and this process's peak resident memory (and the GPU's
    peak allocation, for torch on cuda)."""
    from model.artifact import Manifest

    artifact = Path(impl.split(":", 1)[1]) if impl.startswith("ort:") else Path(impl.split(":", 1)[-1])
    e = Manifest.load(artifact).config.d_model
    x = np.random.default_rng(0).standard_normal((batch, seq, e)).astype(np.float32)
    run = _torch if impl.startswith("torch") else _ort
    seconds = run(artifact, x, threads, repeats, device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"batch": batch, "seq": seq, "seconds": seconds, "peak_rss_mb": peak}


def measure(
    impl: str, batch: int, seq: int, threads: int, repeats: int = 3, timeout: float = 300, device: str = "cpu"
) -> dict | None:
    """One point in a fresh process; None when it failed (out of memory, or timed out)."""
    cmd = [sys.executable, "-m", "bench.cost", impl, str(batch), str(seq), "--threads", str(threads)]
    cmd += ["--device", device]
    try:
        out = subprocess.run(
            [*cmd, "--repeats", str(repeats)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        print(f"  {impl} [{batch},{seq}] failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.splitlines()[-1])


def exponent(points: list[dict], tail: int = 3) -> float:
    """The slope of log(time) against log(seq) over the ``tail`` longest sequences."""
    pts = sorted(points, key=lambda p: p["seq"])[-tail:]
    if len(pts) < 2:
        return float("nan")
    return float(np.polyfit(np.log([p["seq"] for p in pts]), np.log([p["seconds"] for p in pts]), 1)[0])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("impl", help="ort:ARTIFACT_DIR or torch:ARTIFACT_DIR")
    p.add_argument("batch", type=int)
    p.add_argument("seq", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    print(json.dumps(run_point(args.impl, args.batch, args.seq, args.threads, args.repeats, args.device)))


if __name__ == "__main__":
    main()
