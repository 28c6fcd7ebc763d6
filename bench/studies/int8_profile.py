"""Where int8's time goes on this CPU, by operator: the real checkpoint's fp32, int8 and onnxruntime's
``quantize_dynamic`` graphs under onnxruntime's own profiler.

    python -m bench.studies.int8_profile [--runs 10] [--threads 2]

all-MiniLM-L6-v2 (the dev extra), int8's float channels chosen on its real sentences as ``--calibration`` would,
``quantize_dynamic`` as ``python -m bench --real`` builds it (per-channel, reduce_range). Each graph runs
``[8, 128, 384]`` (standard normal embeddings, no padding) 3 times to warm up and ``--runs`` times measured; the
table is each operator type's kernel time per run, summed over its nodes (a subgraph's nodes, an If's branch, are
counted in their own rows and in the If's). docs/parity.md quotes it.
"""

from __future__ import annotations

import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.model.runtime import CPU, session_args

SHAPE = (8, 128, 384)
WARMUP = 3


def main(argv: list[str] | None = None) -> int:

    from addnorm.export.sentences import MORE, SENTENCES
    from addnorm.model.contract import EMBEDDINGS, MASK
    from addnorm.model.runtime import cpu_flags
    from bench.real import real_model, three_graphs

    p = Parser(prog="python -m bench.studies.int8_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="measured runs per graph (default 10)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    args = p.parse_args(argv)

    _, encoder, reference = real_model()
    x, mask = reference.embed([*SENTENCES, *MORE])
    feed = {
        EMBEDDINGS: np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32),
        MASK: np.zeros(SHAPE[:2], bool),
    }
    print(
        f"all-MiniLM-L6-v2, {list(SHAPE)}, {args.threads} threads; CPU flags {' '.join(sorted(cpu_flags()))}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        graphs = three_graphs(encoder, x, mask, tmp)
        for name, path in graphs.items():
            per_run, ops = _profile(path, feed, args.runs, args.threads, tmp / name)
            print(f"\n{name}: {per_run * 1000:.1f} ms per run (wall, profiler on)")
            for op, (ms, nodes) in ops[:14]:
                print(f"  {op:26s} {ms:8.2f} ms  {nodes:3d} nodes")
    return 0


def _profile(path: Path, feed: dict, runs: int, threads: int, prefix: Path) -> tuple[float, list]:
    """(wall seconds per run, [(operator type, (ms per run, nodes)), ...] largest first)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.enable_profiling = True
    opts.profile_file_prefix = str(prefix)
    session = ort.InferenceSession(
        str(path),
        opts,
        **session_args([CPU]),
    )
    for _ in range(WARMUP):
        session.run(None, feed)
    start = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    wall = (time.perf_counter() - start) / runs
    events = json.loads(Path(session.end_profiling()).read_text())
    micros, nodes = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            micros[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    total = runs + WARMUP  # the profiler records the warm-up runs too
    return wall, [(op, (us / total / 1000, nodes[op] // total)) for op, us in micros.most_common()]


if __name__ == "__main__":
    raise SystemExit(main())
