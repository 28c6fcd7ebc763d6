"""The numpy float64 reference (model/reference.py) equals torch's float64 forward of the same block to ~1e-12,
over the forms the exporter produces: post/pre-norm, LayerNorm/RMSNorm, relu/gelu, masks, stacks, layouts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import build_encoder
from addnorm.model.reference import forward, load_weights

FORMS = list(itertools.product([False, True], ["layer", "rms"], ["relu", "gelu"], [1, 2]))


@pytest.mark.parametrize(
    "norm_first, norm, activation, layers",
    FORMS,
    ids=lambda v: str(v) if not isinstance(v, bool) else ("pre" if v else "post"),
)
def test_reference_equals_torch_in_float64(norm_first, norm, activation, layers):
    config = EncoderConfig(
        d_model=32, nhead=4, dim_feedforward=48, dropout=0.0, norm_first=norm_first, norm=norm,
        activation=activation, num_layers=layers,
    )  # fmt: skip
    enc = build_encoder(config, seed=3).double()
    weights = {k: v.detach().numpy() for k, v in enc.state_dict().items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 32)) * 3.0
    mask = np.zeros((3, 7), bool)
    mask[1, 5:] = True
    mask[2, :] = True  # a row that is all padding: uniform attention, as torch's finite fill gives
    for m in (None, mask):
        with torch.no_grad():
            want = enc(torch.from_numpy(x), None if m is None else torch.from_numpy(m)).numpy()
        got = forward(config, weights, x, m)
        assert np.abs(got - want).max() < 1e-12, (np.abs(got - want).max(), m is not None)


def test_seq_first_layout_and_an_artifacts_own_weights(tiny_artifact):
    """(S, B, E) in and out when not batch-first; and weights.safetensors read without torch give the artifact's
    own float32 graph's answer to float32 precision."""
    config = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=False)
    enc = build_encoder(config, seed=1).double()
    weights = {k: v.detach().numpy() for k, v in enc.state_dict().items()}
    x = np.random.default_rng(1).standard_normal((5, 2, 32))
    with torch.no_grad():
        want = enc(torch.from_numpy(x)).numpy()
    assert np.abs(forward(config, weights, x) - want).max() < 1e-12

    import onnxruntime as ort

    from addnorm.model.artifact import Manifest

    manifest = Manifest.load(tiny_artifact)
    x = np.random.default_rng(2).standard_normal((2, 6, 32)).astype(np.float32)
    mask = np.zeros((2, 6), bool)
    mask[0, 4:] = True
    sess = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    graph = sess.run(["encoded"], {"embeddings": x, "mask": mask})[0]
    ref = forward(manifest.config, load_weights(tiny_artifact / "weights.safetensors"), x, mask)
    real = ~mask
    assert np.abs(graph[real] - ref[real]).max() < 1e-4


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("planned", ["first-form", "no-float-channels", "float-channels"])
def test_the_int8_scheme_in_numpy_equals_its_torch_twin(norm_first, planned):
    """model/schemes.py's Int8 (what live parity uses, no torch) computes export/int8.py's scheme as its torch
    twin does (the export gate's), in float64, padded or not, with the float channels an export plans (q, k and
    v are views of one in_proj weight in torch) or without, in the form an export writes today or in the first
    form (an artifact whose manifest names no form)."""
    from addnorm.export.variants import get_variant
    from addnorm.model.schemes import FLOAT_CHANNELS_KEY, Form, Int8, for_variant

    config = EncoderConfig(
        d_model=32, nhead=4, dim_feedforward=48, dropout=0.0, norm_first=norm_first, num_layers=2
    )
    enc = build_encoder(config, seed=5)
    weights = {k: v.detach().double().numpy() for k, v in enc.state_dict().items()}
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 6, 32)) * 2 + 40.0).astype(np.float32)  # an offset: the exact mean term
    mask = np.zeros((2, 6), bool)
    mask[1, 4:] = True
    variant = get_variant("int8")
    plan = {
        "first-form": {},
        "no-float-channels": Form().to_plan(),
        "float-channels": variant.plan(enc, [(x, mask)]),
    }[planned]
    want = variant.scheme(enc, x, mask, False, plan=plan)["encoded"]
    got = forward(config, weights, x, mask, for_variant("int8", plan, weights))
    assert np.abs(got - want).max() < 1e-10
    exact = forward(config, weights, x, mask)
    assert np.abs(got - exact).max() > 1e-4  # and it is not the exact block
    # width // 16 float channels (2 of 32; 3 of linear2's 48), chosen per weight; they change the answer
    if planned == "float-channels":
        assert sorted(len(v) for v in plan[FLOAT_CHANNELS_KEY].values()) == [2] * 6 + [3] * 2
        assert len(plan[FLOAT_CHANNELS_KEY]) == 4 * config.num_layers
        assert np.abs(got - forward(config, weights, x, mask, Int8())).max() > 1e-6


def test_the_fp16_scheme_in_numpy_is_as_far_from_float64_as_torch_half():
    """Half rounds every stored result to fp16 as torch's CPU half kernels do: not bit-equal (the order of sums
    differs), but the same size of error against float64, which is all live parity's allowance needs."""
    from addnorm.model.schemes import Half

    config = EncoderConfig(d_model=32, nhead=4, dim_feedforward=48, dropout=0.0, num_layers=2)
    enc = build_encoder(config, seed=6)
    w64 = {k: v.detach().double().numpy() for k, v in enc.state_dict().items()}
    x = np.random.default_rng(5).standard_normal((2, 6, 32)).astype(np.float32)
    oracle = forward(config, w64, x)
    with torch.no_grad():
        torch_half = enc.half()(torch.from_numpy(x).half()).double().numpy()
    ours = forward(config, {k: v.astype(np.float32) for k, v in w64.items()}, x, None, Half())
    torch_err, our_err = np.abs(torch_half - oracle).max(), np.abs(ours - oracle).max()
    assert our_err > 1e-4 and 0.25 < our_err / torch_err < 4, (our_err, torch_err)
    assert np.abs(ours - torch_half).max() < 4 * torch_err
