"""int8's numbers (model/schemes.py): the pair-bounded 8-bit weights and each row's quantization, by their
definitions; tests/export/test_cpu_kinds.py shows the weights exact on an emulated AVX2 CPU."""

from __future__ import annotations

import numpy as np
import pytest

from addnorm.model.schemes import LEGACY, PAIR_BOUND, Form, quantize_weight, quantize_weight_pairs


@pytest.mark.parametrize("rows", [384, 33])  # an odd width pairs its last channel with a zero
def test_pair_bounded_weights_keep_every_pair_within_the_int16_sum_and_round_to_half_a_level(rows):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, 64)) * np.exp(rng.standard_normal((rows, 1)))  # some large input channels
    w[:, 0] = 1.0  # equal values: every pair at the column's peak
    w[:, 1] = 0.0  # an all-zero column
    q, scale = quantize_weight_pairs(w)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.dtype == np.float32
    padded = np.concatenate([q.astype(np.int64), np.zeros((rows % 2, 64), np.int64)])
    for sign in (1, -1):
        part = np.maximum(sign * padded, 0)
        assert (part[0::2] + part[1::2]).max() <= PAIR_BOUND
    assert np.abs(q).max() <= 127
    step = scale.astype(np.float64)
    assert (np.abs(q * step - w) <= 0.5 * step + 1e-12).all()  # a moved member stays within half a level
    assert (q[:, 0] == 64).all() and (q[:, 1] == 0).all()  # 2 x 64 = 128: the bound, not 127 levels
    # finer than 7-bit weights wherever a column's pairs allow it: mean error about 1.6x smaller here
    seven, s7 = quantize_weight(w)
    assert np.abs(q * step - w).mean() < 0.75 * np.abs(seven * s7.astype(np.float64) - w).mean()


def test_minmax_rows_span_their_own_least_to_largest_value_around_their_mean():
    rng = np.random.default_rng(1)
    x = np.abs(rng.standard_normal((6, 48))) - 0.17  # GELU-like: skewed, few negatives
    x[0] = 3.0  # a constant row
    x[1, 7] = 40.0  # an outlier in a float channel
    x[2] += 1e4  # a large offset: carried exactly by the centre, none of the row's bits spent on it
    idx = np.array([7, 20])
    levels, step, base, centre = Form().rows_of(x, idx)
    keep = np.ones(48, bool)
    keep[idx] = False
    np.testing.assert_allclose(centre[:, 0], x[:, keep].mean(axis=1))
    back = centre + base + levels * step
    assert (np.abs(back - x)[:, keep] <= 0.5 * step + 1e-9).all()
    assert (levels[:, idx] == 0).all() and levels.min() >= -128 and levels.max() <= 127
    span = levels[1:].max(axis=1) - levels[1:].min(axis=1)
    assert (span == 254).all()  # the row's least and largest values, 254 steps apart, never saturated
    assert step[1, 0] < 0.1 and step[2, 0] < 0.1  # neither the outlier nor the offset widened the row's steps
    old_levels, old_step, *_ = LEGACY.rows_of(x, idx)
    assert (step[3:] < 0.75 * old_step[3:]).all()  # a skewed row: finer steps than +- its reach from the mean


def test_a_manifest_scheme_names_its_form_and_an_unnamed_one_is_the_first():
    assert Form.of({}) == LEGACY == Form("7bit", "mean")
    assert Form.of(Form().to_plan()) == Form() == Form("pairs8", "minmax")
    with pytest.raises(ValueError, match="unknown int8 form"):
        Form.of({"weights": "4bit"})
