"""export/yardsticks.py: a lossy graph's steps judged on the graph's own previous step."""

import dataclasses
import functools

import numpy as np
import pytest

from addnorm.export.parity import torch_outputs
from addnorm.export.variants import VARIANTS
from addnorm.export.yardsticks import teacher_forced
from addnorm.model.contract import STEP_OUTPUT
from addnorm.model.encoder import build_encoder
from tests.conftest import TINY


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_steps_given_torchs_own_steps_are_torchs_steps(norm_first, batch_first):
    """Fed torch fp32's own steps, the fp32 steps are exactly those steps (each Add & Norm step of the block, a
    pre-norm stack's final norm, either layout), and fp16's scheme is within half precision of them."""
    config = dataclasses.replace(TINY, num_layers=3, norm_first=norm_first, batch_first=batch_first)
    encoder = build_encoder(config)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 32) if batch_first else (5, 2, 32)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    mask[1, 3:] = True
    outs = torch_outputs(encoder, x, mask, with_steps=True)
    names = sorted((n for n in outs if n.startswith("add_norm_")), key=lambda n: int(n.rsplit("_", 1)[1]))
    assert len(names) == 2 * 3 + int(norm_first)
    scheme, fp32 = teacher_forced(VARIANTS["fp16"].scheme_model, encoder, x, mask, [outs[n] for n in names])
    assert list(fp32) == [STEP_OUTPUT.format(i) for i in range(len(names))] == list(scheme)
    for name in names:
        np.testing.assert_array_equal(fp32[name], outs[name].astype(np.float64), err_msg=name)
        real = ~mask
        np.testing.assert_allclose(scheme[name][real], fp32[name][real], atol=2e-2, err_msg=name)


def test_a_runs_int8_scheme_quantizes_each_weight_once_and_computes_what_a_fresh_one_does(monkeypatch):
    """Variant.for_run: the scheme's module is built at the run's first case and kept, so int8's weights are
    quantized once a run (export.int8.Simulated), not once per product; every case's answer is the one a scheme
    built for that case alone gives, steps and teacher-forced steps included."""
    from addnorm.export.cases import default_cases
    from addnorm.export.pipeline import plan_for
    from addnorm.model import schemes

    config = dataclasses.replace(TINY, num_layers=2)
    encoder = build_encoder(config)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, s, 32)).astype(np.float32) for s in (3, 5, 9)]
    mask = {s: np.zeros((2, s), bool) for s in (3, 5, 9)}
    variant = VARIANTS["int8"]
    plan = plan_for(encoder, "int8", default_cases())
    quantized = []
    real_quantize = schemes.Form.quantize

    def counted(form, w):
        quantized.append(w.shape)
        return real_quantize(form, w)

    monkeypatch.setattr(schemes.Form, "quantize", counted)
    scheme, model = variant.for_run(plan)
    for x in inputs:
        m = mask[x.shape[1]]
        run = scheme(encoder, x, m, True)
        alone = variant.scheme(encoder, x, m, True, plan=plan)
        assert run.keys() == alone.keys()
        for name in run:
            np.testing.assert_array_equal(run[name], alone[name], err_msg=name)
        steps = [run[STEP_OUTPUT.format(i)].astype(np.float32) for i in range(2 * config.num_layers)]
        forced_run, _ = teacher_forced(model, encoder, x, m, steps)
        forced_alone, _ = teacher_forced(
            functools.partial(variant.scheme_model, plan=plan), encoder, x, m, steps
        )
        for name in forced_run:
            np.testing.assert_array_equal(forced_run[name], forced_alone[name], err_msg=name)
    products = 6 * config.num_layers  # q, k, v, out, linear1, linear2 per layer
    fresh = len(inputs) * 2 * products  # the schemes built per case alone: end to end, and teacher-forced
    assert len(quantized) == products + fresh, len(quantized)  # the run's scheme: each weight once
