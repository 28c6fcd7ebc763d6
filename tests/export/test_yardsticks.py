"""export/yardsticks.py: a lossy graph's steps judged on the graph's own previous step."""

import dataclasses

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
