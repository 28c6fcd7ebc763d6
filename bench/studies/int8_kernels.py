"""What int8's kernels buy on the real checkpoint: int8 on onnxruntime's standard operators and on model/kernels.

    python -m bench.studies.int8_kernels [--rounds 5] [--seconds 1] [--isa avx2|vnni|amx]

Issue 34 asks int8 at onnxruntime's ``quantize_dynamic`` speed with int8's accuracy. An int8 artifact's graph holds
its two steps as ONNX functions (export/int8_ops.py): onnxruntime inlines them into about 20 standard operators per
quantized activation and 6 per product, or, with model/kernels' library registered (as the server does where it
is built), runs one kernel for each. This measures fp32, int8 both ways and ``quantize_dynamic`` side by side on
all-MiniLM-L6-v2: each graph's answers on real sentences against transformers, and its time on ``[8,128,384]``
(the graphs taking turns, median of the rounds). ``--isa`` caps the kernels' instructions (ADDNORM_KERNELS_ISA),
onnxruntime's own kernels still using what this CPU has; ``python -m bench.emulate avx2 -- python -m
bench.studies.int8_kernels`` runs all of it as on a smaller CPU.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.model.runtime import CPU, session_args


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.int8_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of the graphs taking turns (default 5)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per graph per round (default 1)")
    p.add_argument(
        "--isa", choices=("avx2", "vnni", "amx"), help="the widest instructions the kernels may use"
    )
    args = p.parse_args(argv)
    if args.isa:  # read by the library when it loads, below
        os.environ["ADDNORM_KERNELS_ISA"] = args.isa

    import onnxruntime as ort

    from addnorm.export import agreement
    from addnorm.export.sentences import MORE, SENTENCES
    from addnorm.model import kernels
    from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
    from addnorm.model.runtime import cpu_flags
    from bench.real import alternate, real_model, three_graphs

    try:
        library = kernels.build()
    except kernels.KernelError as exc:
        p.error(str(exc))
    if lacks := kernels.cpu_lacks():
        p.error(f"the kernels need {', '.join(lacks)}; this CPU's flags: {' '.join(sorted(cpu_flags()))}")
    config, encoder, reference = real_model()
    x, mask = reference.embed([*SENTENCES, *MORE])
    want = reference.encode(x, mask)
    emulated = (
        f" (emulated: python -m bench.emulate {os.environ['ADDNORM_EMULATE']})"
        if "ADDNORM_EMULATE" in os.environ
        else ""
    )
    print(
        f"all-MiniLM-L6-v2, {len(x)} sentences; CPU flags {' '.join(sorted(cpu_flags()))}"
        f"{emulated}; kernels {library.name} on {kernels.isa(library)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = three_graphs(encoder, x, mask, Path(tmp))
        graphs = {
            "fp32": (paths["fp32"], None),
            "int8, standard operators": (paths["int8"], None),
            "int8, kernels": (paths["int8"], library),
            "quantize_dynamic": (paths["quantize_dynamic"], None),
        }
        sessions = {}
        for name, (path, lib) in graphs.items():
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server runs
            if lib is not None:
                opts.register_custom_ops_library(str(lib))
            sessions[name] = ort.InferenceSession(
                str(path),
                opts,
                **session_args([CPU]),
            )
        bench_x = np.random.default_rng(0).standard_normal((8, 128, config.d_model)).astype(np.float32)
        times = alternate(
            sessions, {EMBEDDINGS: bench_x, MASK: np.zeros((8, 128), bool)}, args.rounds, args.seconds
        )
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"\n{'graph':<26} {'max err vs transformers':>24} {'least cosine':>13} {'Spearman':>9} "
            f"{'[8,128,384] ms':>15} {'vs fp32':>8} {'vs quantize_dynamic':>20}"
        )
        for name, session in sessions.items():
            agree = agreement.agreement(session.run([ENCODED], {EMBEDDINGS: x, MASK: mask})[0], want, mask)
            print(
                f"{name:<26} {agree.max_abs:24.2e} {agree.min_sentence_cosine:13.6f} {agree.spearman:9.4f} "
                f"{ms[name]:15.2f} {ms['fp32'] / ms[name]:7.2f}x {ms['quantize_dynamic'] / ms[name]:19.2f}x"
            )
        print(
            f"(medians of {args.rounds} rounds; each round's ms: "
            + "; ".join(f"{name} {', '.join(f'{t:.1f}' for t in times[name])}" for name in sessions)
            + ")"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
