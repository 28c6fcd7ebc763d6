"""int8 schemes side by side: fp32, onnxruntime's ``quantize_dynamic`` (the scheme before export/int8.py) and
addnorm's per-row int8, on the same weights, in one process.

    python -m bench.studies.int8 [--d-model 768] [--layers 1] [--attention mha] [--seconds 2] [--rounds 3]

Speed: [8, 128, d_model], the three sessions alternating, ``--rounds`` rounds; the median per scheme and its ratio
to fp32. Accuracy: the worst row's relative RMS error against the float64 oracle over the export gate's 20
ordinary cases and over the adversarial suite's offset cases. This CPU's SIMD flags are printed with them:
``quantize_dynamic`` saturates on CPUs without VNNI (docs/parity.md).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.model.runtime import CPU, session_args


def main(argv: list[str] | None = None) -> int:
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from addnorm.export.cases import adversarial_cases, default_cases
    from addnorm.export.parity import torch_outputs
    from addnorm.export.pipeline import plan_for
    from addnorm.export.variants import _quiet, _toposort, build_graph
    from addnorm.model.config import EncoderConfig
    from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
    from addnorm.model.encoder import build_encoder
    from addnorm.model.runtime import cpu_flags

    p = Parser(prog="python -m bench.studies.int8", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--attention", default="mha")
    p.add_argument("--seconds", type=float, default=2.0, help="time per scheme per round (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    e = args.d_model
    cfg = EncoderConfig(
        d_model=e, nhead=max(1, e // 64), dim_feedforward=4 * e, dropout=0.0, num_layers=args.layers
    )
    encoder = build_encoder(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: Path(tmp) / f"{v}.onnx" for v in ("fp32", "quantize_dynamic", "int8")}
        build_graph(encoder, paths["fp32"], "fp32", attention=args.attention)
        # its float channels, as an export without --calibration chooses them
        plan = plan_for(encoder, "int8", default_cases())
        build_graph(encoder, paths["int8"], "int8", attention=args.attention, plan=plan)
        with _quiet():
            quant_pre_process(str(paths["fp32"]), str(Path(tmp) / "pre.onnx"))
            quantize_dynamic(
                Path(tmp) / "pre.onnx",
                paths["quantize_dynamic"],
                weight_type=QuantType.QInt8,
                extra_options={"MatMulConstBOnly": True},
            )
        model = onnx.load(str(paths["quantize_dynamic"]))
        _toposort(model.graph)
        onnx.save(model, str(paths["quantize_dynamic"]))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sessions = {
            v: ort.InferenceSession(
                str(p),
                opts,
                **session_args([CPU]),
            )
            for v, p in paths.items()
        }

        x = np.random.default_rng(0).standard_normal((8, 128, e)).astype(np.float32)
        feed = {EMBEDDINGS: x, MASK: np.zeros((8, 128), bool)}
        ms: dict[str, list[float]] = {v: [] for v in sessions}
        for s in sessions.values():
            s.run(None, feed)
        for _ in range(args.rounds):
            for v, s in sessions.items():
                runs, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.seconds:
                    s.run(None, feed)
                    runs += 1
                ms[v].append((time.perf_counter() - start) / runs * 1e3)

        oracle = copy.deepcopy(encoder).double()
        rng = np.random.default_rng(1234)
        worst: dict[str, dict[str, float]] = {v: {"ordinary": 0.0, "offsets": 0.0} for v in sessions}
        for case in default_cases() + [c for c in adversarial_cases() if c.name.startswith("offset")]:
            xc, mask = case.make(e, rng)
            exact = torch_outputs(oracle, xc.astype(np.float64), mask, False)[ENCODED]
            kind = "offsets" if case.name.startswith("offset") else "ordinary"
            for v, s in sessions.items():
                got = s.run(None, {EMBEDDINGS: xc, MASK: mask})[0].astype(np.float64)
                rows = np.sqrt(((got - exact) ** 2).mean(-1)) / np.sqrt((exact**2).mean(-1))
                worst[v][kind] = max(worst[v][kind], float(rows.max()))

    print(
        f"CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}; d_model {e}, {args.layers} layer(s), {args.attention}"
    )
    base = statistics.median(ms["fp32"])
    print(f"{'scheme':<18} {'[8,128,E] ms':>13} {'vs fp32':>8} {'worst row, ordinary':>20} {'offsets':>9}")
    for v in sessions:
        med = statistics.median(ms[v])
        w = worst[v]
        print(
            f"{v:<18} {med:13.2f} {base / med:7.2f}x {100 * w['ordinary']:19.2f}% {100 * w['offsets']:8.2f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
