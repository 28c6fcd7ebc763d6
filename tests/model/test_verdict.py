"""The per-row bounds of lossy variants (model/verdict.py): each measure sees what it is for."""

import numpy as np

from model.verdict import Tolerance, compare, row_errors

ROWS = Tolerance(atol=None, rtol=0.0, oracle_factor=2.0, row_rel_rms=0.03, row_cosine=0.9995, row_peak=0.15)


def _rows() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((2, 6, 64))


def test_a_row_scaled_by_5_percent_fails_on_relative_rms_though_its_direction_holds():
    ref = _rows()
    out = ref.copy()
    out[1, 2] *= 1.05
    rel, cos, peak = row_errors(out, ref, np.abs(out - ref))
    assert abs(rel - 0.05) < 1e-12 and cos > 1 - 1e-12 and peak > 0.05
    assert not compare("y", out, ref, ref, ROWS).passed


def test_one_corrupted_feature_fails_on_the_worst_element_though_the_row_rms_barely_moves():
    ref = _rows()
    out = ref.copy()
    out[0, 0, 5] += 0.2 * np.sqrt(np.mean(ref[0, 0] ** 2))  # one feature, 0.2 x its row's RMS
    rel, _, peak = row_errors(out, ref, np.abs(out - ref))
    assert rel < ROWS.row_rel_rms and peak > ROWS.row_peak
    assert not compare("y", out, ref, ref, ROWS).passed


def test_noise_of_one_percent_per_row_passes_and_the_scheme_rescues_what_it_cannot_do_better():
    rng = np.random.default_rng(1)
    ref = _rows()
    out = ref + 0.01 * rng.standard_normal(ref.shape) * np.sqrt(np.mean(ref**2, -1, keepdims=True))
    assert compare("y", out, ref, ref, ROWS).within_tolerance
    far = ref + 0.5 * rng.standard_normal(ref.shape)  # the graph as far from exact as its scheme itself is
    scheme = ref + 0.5 * rng.standard_normal(ref.shape)
    assert not compare("y", far, ref, ref, ROWS).passed
    result = compare("y", far, ref, ref, ROWS, scheme=scheme)
    assert result.passed and not result.within_tolerance and result.scheme_vs_f64 > 1.0


def test_a_scheme_that_overflows_rescues_nothing():
    """fp16's scheme on a 1e4-scale input is inf: its error is no allowance (it would pass any answer)."""
    ref = _rows()
    far = ref * 1.3
    scheme = ref.copy()
    scheme[0, 0, 0] = np.inf
    result = compare("y", far, ref, ref, ROWS, scheme=scheme)
    assert not result.passed and result.scheme_vs_f64 is None


def test_the_ratio_is_over_one_exactly_when_the_verdict_fails():
    """Comparison.ratio (live parity's figure) agrees with ``passed`` over fp32 and row tolerances, on answers
    from exact to 10% off."""
    rng = np.random.default_rng(2)
    oracle = _rows()
    ref = oracle + 1e-6 * rng.standard_normal(oracle.shape)
    for tol in (Tolerance(), ROWS):
        for noise in (0.0, 1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 0.1):
            out = oracle + noise * rng.standard_normal(oracle.shape)
            c = compare("y", out, ref, oracle, tol)
            assert c.passed == (c.ratio <= 1), (tol, noise, c.ratio, c.passed)
