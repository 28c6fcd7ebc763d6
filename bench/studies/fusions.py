"""onnxruntime's graph rewrites the server turns off on CPU (model.runtime.CPU_DISABLED_OPTIMIZERS), measured.

    python -m bench.studies.fusions [--artifact DIR] [--rounds 30]

Each graph in two sessions, onnxruntime's defaults and as the server makes it (without the rewrites), taking turns
run by run on the same input: all-MiniLM-L6-v2 fp32 and int8 (on model/kernels where built, as served), against
transformers on real sentences, and an artifact (``make serve``'s default model). Prints each shape's medians and
the ratio; run it as another CPU kind with ``python -m bench.emulate avx2 -- python -m bench.studies.fusions``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.runtime import CPU, CPU_DISABLED_OPTIMIZERS

SHAPES = ((8, 128), (1, 16), (32, 16))


def _sessions(path: Path, library: Path | None) -> dict:
    import onnxruntime as ort

    out = {}
    for name, disabled in (("defaults", None), ("served", list(CPU_DISABLED_OPTIMIZERS))):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server runs
        if library is not None:
            opts.register_custom_ops_library(str(library))
        out[name] = ort.InferenceSession(str(path), opts, providers=[CPU], disabled_optimizers=disabled)
    return out


def turns_at(sessions: dict, rows: int, positions: int, width: int, rounds: int) -> dict[str, float]:
    """``_turns`` on one random batch of ``[rows, positions, width]``, no padding; shapes of fewer than 512
    positions in all run 10x ``rounds`` (their runs are short)."""
    from addnorm.model.contract import EMBEDDINGS, MASK

    feed = {
        EMBEDDINGS: np.random.default_rng(0).standard_normal((rows, positions, width)).astype(np.float32),
        MASK: np.zeros((rows, positions), bool),
    }
    return _turns(sessions, feed, rounds * (10 if rows * positions < 512 else 1))


def _turns(sessions: dict, feed: dict, rounds: int) -> dict[str, float]:
    """Median ms per run of each session, the sessions taking turns run by run."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for s in sessions.values():
        s.run(None, feed)
    for _ in range(rounds):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(None, feed)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.fusions", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="a model directory too")
    p.add_argument(
        "--rounds", type=int, default=30, help="runs of each session per shape (x10 for small ones)"
    )
    args = p.parse_args(argv)

    from addnorm.export import agreement
    from addnorm.model import kernels
    from addnorm.model.artifact import MODEL_FILE, Manifest
    from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
    from bench.emulate import described_cpu
    from bench.real import real_sentences, three_graphs

    config, encoder, _, x, mask, want = real_sentences()
    print(f"disabled on CPU: {', '.join(CPU_DISABLED_OPTIMIZERS)}; {described_cpu()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = three_graphs(encoder, x, mask, Path(tmp))
        library = kernels.find()
        graphs = [
            ("all-MiniLM-L6-v2 fp32", paths["fp32"], None, config.d_model),
            (
                f"all-MiniLM-L6-v2 int8{', kernels' if library else ''}",
                paths["int8"],
                library,
                config.d_model,
            ),
        ]
        if (args.artifact / MODEL_FILE).is_file():
            manifest = Manifest.load(args.artifact)
            graphs.append(
                (
                    f"{args.artifact} ({manifest.variant})",
                    args.artifact / MODEL_FILE,
                    None,
                    manifest.config.d_model,
                )
            )
        print(f"\n{'graph':<34} {'shape':>14} {'defaults ms':>12} {'served ms':>10} {'served speed':>13}")
        for name, path, lib, width in graphs:
            sessions = _sessions(path, lib)
            if width == config.d_model and "MiniLM" in name:
                agree = {
                    k: agreement.agreement(s.run([ENCODED], {EMBEDDINGS: x, MASK: mask})[0], want, mask)
                    for k, s in sessions.items()
                }
                print(
                    f"{name}: vs transformers on real tokens, "
                    + "; ".join(
                        f"{k} max err {a.max_abs:.2e}, least cosine {a.min_sentence_cosine:.6f}"
                        for k, a in agree.items()
                    )
                )
            for b, s in SHAPES:
                ms = turns_at(sessions, b, s, width, args.rounds)
                print(
                    f"{name:<34} {str([b, s, width]):>14} {ms['defaults']:12.2f} {ms['served']:10.2f} "
                    f"{ms['defaults'] / ms['served']:12.2f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
