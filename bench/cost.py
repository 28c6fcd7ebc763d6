"""The cost curve: time and peak resident memory of one [B, S, E] run, against S and against B.

Each point runs in a process of its own (``python -m bench.cost POINT``), so its peak resident memory (the OS's
``VmHWM``) is that point's alone. Implementations: ``ort:DIR`` (the artifact in DIR through the serving
``Engine``), and ``torch`` (torch eager ``nn.TransformerEncoderLayer`` on the same weights, the best of its fast
path on and off). The exponent of time against S is fitted over the long end, where attention dominates.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from bench.server import ROOT

SEQS = (16, 64, 256, 1024, 2048, 4096, 8192)
BATCHES = (1, 4, 16, 64)
BATCH_SEQ = 128
MEMORY_CAP_GB = 16.0  # a point whose predicted peak exceeds this is skipped ("as far as memory allows")


def _time(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _ort(artifact: Path, x: np.ndarray, threads: int, repeats: int, device: str) -> float:
    from addnorm.service.backend.engine import Engine

    engine = Engine(artifact, device, threads)
    return _time(lambda: engine.run(x), repeats)


def _torch(artifact: Path, x: np.ndarray, threads: int, repeats: int, device: str) -> float:
    import torch
    from torch import nn

    from addnorm.export.weights import read_state_dict
    from addnorm.model.artifact import WEIGHTS_FILE, Manifest

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
    from addnorm.model.artifact import Manifest

    artifact = Path(impl.split(":", 1)[1])  # ort:DIR or torch:DIR
    e = Manifest.load(artifact).config.d_model
    x = np.random.default_rng(0).standard_normal((batch, seq, e)).astype(np.float32)
    run = _torch if impl.startswith("torch") else _ort
    seconds = run(artifact, x, threads, repeats, device)
    return {"batch": batch, "seq": seq, "seconds": seconds, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so
    a point started by a large parent would report the parent's peak."""
    return process_peak_mb("self") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_peak_mb(pid: int | str) -> float:
    """A process's peak resident memory (its VmHWM), 0.0 where /proc cannot tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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


def predicted_peak_gb(form: str, batch: int, seq: int, heads: int, d_model: int) -> float:
    """Rough peak memory of an onnxruntime point: its seq x seq tensors, activations, a fixed base."""
    from addnorm.model.attention import score_elements

    scores = score_elements(form, batch, heads, seq, padded=False) * 4
    activations = 12 * batch * seq * d_model * 4 * 4  # the FFN's 4x-wide hidden and a few (B, S, E) buffers
    return (scores + activations) / 1e9 + 0.5


def curve_artifacts(artifact: Path, work: Path) -> dict[str, Path]:
    """The artifact's weights exported once per attention form (mha, decomposed), for a fair comparison."""
    from addnorm.export.pipeline import export_artifact
    from addnorm.export.weights import load_weights
    from addnorm.model.artifact import WEIGHTS_FILE, Manifest
    from addnorm.model.encoder import Encoder

    manifest = Manifest.load(artifact)
    out = {}
    for form in ("mha", "decomposed"):
        target = work / form
        if not (target / "manifest.json").exists():
            encoder = load_weights(Encoder(manifest.config), artifact / WEIGHTS_FILE)
            export_artifact(encoder, target, manifest.name, manifest.opset, manifest.variant, attention=form)
        out[form] = target
    return out


def curve(artifacts: dict[str, Path], threads: int, cap_gb: float = MEMORY_CAP_GB) -> dict:
    """Every point of both curves for ort:<form> and torch; a point predicted past ``cap_gb`` is skipped."""
    from addnorm.model.artifact import Manifest

    cfg = Manifest.load(artifacts["mha"]).config
    impls = {f"onnxruntime {form}": (f"ort:{path}", form) for form, path in artifacts.items()}
    impls["torch eager"] = (f"torch:{artifacts['mha']}", "mha")  # flash attention on its fast path
    res: dict = {"seq": {}, "batch": {}, "skipped": []}
    for label, (impl, form) in impls.items():
        for axis, points in (("seq", [(1, s) for s in SEQS]), ("batch", [(b, BATCH_SEQ) for b in BATCHES])):
            rows = res[axis].setdefault(label, [])
            for b, s in points:
                if predicted_peak_gb(form, b, s, cfg.nhead, cfg.d_model) > cap_gb:
                    res["skipped"].append(f"{label} [{b},{s}]")
                    continue
                print(f"  {label} [{b},{s},{cfg.d_model}]", file=sys.stderr, flush=True)
                point = measure(impl, b, s, threads)
                if point is not None:
                    rows.append(point)
    res["exponent"] = {label: exponent(rows) for label, rows in res["seq"].items()}
    return res


def headline(artifacts: dict[str, Path], threads: int, rounds: int = 3) -> dict:
    """The issue's two comparisons, side by side in fresh processes, ``rounds`` times (median ratio):
    mha against torch eager at [1, 4096], and mha against decomposed at [8, 128]."""
    pairs = {
        "[1,4096] mha / torch eager": ((1, 4096), f"ort:{artifacts['mha']}", f"torch:{artifacts['mha']}"),
        "[8,128] mha / decomposed": ((8, 128), f"ort:{artifacts['mha']}", f"ort:{artifacts['decomposed']}"),
    }
    out = {}
    for name, ((b, s), ours, theirs) in pairs.items():
        runs = []
        for r in range(rounds):
            order = (ours, theirs) if r % 2 == 0 else (theirs, ours)
            got = {impl: measure(impl, b, s, threads, repeats=10) for impl in order}
            if all(got.values()):
                runs.append(got)
        out[name] = {
            "time_ratio": float(np.median([g[theirs]["seconds"] / g[ours]["seconds"] for g in runs])),
            "memory_ratio": float(
                np.median([g[theirs]["peak_rss_mb"] / g[ours]["peak_rss_mb"] for g in runs])
            ),
            "ours_seconds": float(np.median([g[ours]["seconds"] for g in runs])),
            "theirs_seconds": float(np.median([g[theirs]["seconds"] for g in runs])),
            "ours_peak_mb": float(np.median([g[ours]["peak_rss_mb"] for g in runs])),
            "theirs_peak_mb": float(np.median([g[theirs]["peak_rss_mb"] for g in runs])),
        }
    return out


def curve_table(res: dict) -> str:
    lines = ["| implementation | " + " | ".join(f"S={s}" for s in SEQS) + " | exponent (long end) |"]
    lines.append("|---" * (len(SEQS) + 2) + "|")
    for label, rows in res["curve"]["seq"].items():
        by_seq = {p["seq"]: p for p in rows}
        cells = [
            f"{by_seq[s]['seconds']:.3g} s / {by_seq[s]['peak_rss_mb']:.0f} MB" if s in by_seq else "-"
            for s in SEQS
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {res['curve']['exponent'][label]:.2f} |")
    lines += ["", "| implementation | " + " | ".join(f"B={b}" for b in BATCHES) + " |"]
    lines.append("|---" * (len(BATCHES) + 1) + "|")
    for label, rows in res["curve"]["batch"].items():
        by_b = {p["batch"]: p for p in rows}
        cells = [
            f"{by_b[b]['seconds'] * 1e3:.1f} ms / {by_b[b]['peak_rss_mb']:.0f} MB" if b in by_b else "-"
            for b in BATCHES
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| side by side, median of 3 | theirs / ours time | theirs / ours peak memory | ours | theirs |",
    ]
    lines.append("|---|---|---|---|---|")
    for name, h in res["headline"].items():
        lines.append(
            f"| {name} | {h['time_ratio']:.2f}x | {h['memory_ratio']:.2f}x | {h['ours_seconds']:.3f} s, "
            f"{h['ours_peak_mb']:.0f} MB | {h['theirs_seconds']:.3f} s, {h['theirs_peak_mb']:.0f} MB |"
        )
    if long := res.get("long"):
        a, t = "addnorm", "sentence-transformers"
        lines.append(
            f"| one 8,192-token text, ModernBERT-base's shape ({long['layers']} layers): addnorm / "
            f"sentence-transformers (torch eager) | {long['time_ratio']:.2f}x | {long['memory_ratio']:.2f}x | "
            f"{long['seconds'][a]:.2f} s, {long['peak_rss_mb'][a]:.0f} MB | {long['seconds'][t]:.2f} s, "
            f"{long['peak_rss_mb'][t]:.0f} MB |"
        )
    if res["curve"]["skipped"]:
        lines.append(
            f"\nSkipped (predicted past {MEMORY_CAP_GB:.0f} GB): {', '.join(res['curve']['skipped'])}"
        )
    return "\n".join(lines)


def plot_curve(res: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, rows in res["curve"]["seq"].items():
        rows = sorted(rows, key=lambda p: p["seq"])
        axes[0].plot([p["seq"] for p in rows], [p["seconds"] for p in rows], marker="o", label=label)
        axes[1].plot([p["seq"] for p in rows], [p["peak_rss_mb"] for p in rows], marker="o", label=label)
    for label, rows in res["curve"]["batch"].items():
        rows = sorted(rows, key=lambda p: p["batch"])
        axes[2].plot([p["batch"] for p in rows], [p["seconds"] for p in rows], marker="o", label=label)
    titles = (
        "time of one [1, S, E] run",
        "peak resident memory, [1, S, E]",
        f"time of one [B, {BATCH_SEQ}, E] run",
    )
    for ax, title, xlabel, ylabel in zip(
        axes, titles, ("S", "S", "B"), ("seconds", "MB", "seconds"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    path = out / "cost_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = Parser(prog="python -m bench.cost", description=__doc__.split("\n\n")[0])
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
