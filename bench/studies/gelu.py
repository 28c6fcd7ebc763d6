"""The mha form's exact GELU as onnxruntime's one operator against the exporter's standard spelling, measured.

    python -m bench.studies.gelu [--rounds 30]

all-MiniLM-L6-v2 (the dev extra's) exported twice in the mha form: as export/attention.py spells it (one
``com.microsoft.Gelu`` a layer, which onnxruntime's session fuses with the bias add before it into ``BiasGelu``) and
with the standard spelling (Div, Erf, Add, Mul, Mul, which onnxruntime 1.32 does not fuse). Both in sessions made as
the server makes them (``model.runtime.session_args``, two threads; one sentence's run spinning as a lone request's,
the batches' asleep as loaded runs), taking turns run by run on the same input. Prints each graph's agreement with
transformers on real sentences, then each shape's medians and the ratio; run it as another CPU kind with
``python -m bench.emulate avx2 -- python -m bench.studies.gelu``. docs/benchmarks.md, "GELU as one operator".
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from addnorm.commands import Parser
from addnorm.model.runtime import CPU, session_args
from addnorm.service.backend.cores import default_threads
from bench.studies.fusions import turns_at

SHAPES = ((1, 16), (1, 64), (8, 16), (32, 16), (8, 128))  # (rows, positions)


def _session(path: Path, spin: bool):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = default_threads()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), opts, **session_args([CPU]))


def graphs(encoder, tmp: Path) -> dict[str, Path]:
    """``encoder``'s fp32 mha graph as exported ("one operator") and with the standard GELU: name -> path."""
    from unittest import mock

    from addnorm.export import attention
    from addnorm.export.variants import build_graph

    build_graph(encoder, tmp / "gelu.onnx", "fp32", attention="mha")
    with mock.patch.dict(attention.GELUS, clear=True):  # no form spells it as onnxruntime's
        build_graph(encoder, tmp / "standard.onnx", "fp32", attention="mha")
    return {"one operator": tmp / "gelu.onnx", "standard": tmp / "standard.onnx"}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.gelu", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="runs of each graph per shape (x10 for small ones)")
    args = p.parse_args(argv)

    import onnx

    from addnorm.export import agreement
    from addnorm.export.checks import op_counts
    from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
    from bench.emulate import described_cpu
    from bench.real import real_sentences

    config, encoder, _, x, mask, want = real_sentences()
    print(f"all-MiniLM-L6-v2 fp32, mha; {described_cpu()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = graphs(encoder, Path(tmp))
        for name, path in paths.items():
            counts = op_counts(onnx.load(str(path)))
            a = agreement.agreement(
                _session(path, False).run([ENCODED], {EMBEDDINGS: x, MASK: mask})[0], want, mask
            )
            print(
                f"{name}: {counts['Gelu']} Gelu, {counts['Erf']} Erf nodes; vs transformers on real tokens max err "
                f"{a.max_abs:.2e}, least cosine {a.min_sentence_cosine:.6f}"
            )
        print(f"\n{'shape':>14} {'standard ms':>12} {'one operator ms':>16} {'speed':>7}")
        for rows, positions in SHAPES:
            spin = rows == 1  # a lone request's run spins (--intra-op-spinning light); loaded runs sleep
            sessions = {name: _session(path, spin) for name, path in paths.items()}
            ms = turns_at(sessions, rows, positions, config.d_model, args.rounds)
            print(
                f"{str([rows, positions, config.d_model]):>14} {ms['standard']:12.2f} {ms['one operator']:16.2f} "
                f"{ms['standard'] / ms['one operator']:6.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
