"""vLLM's narrow float answers (``embed_dtype`` bfloat16, fp8_e4m3, fp8_e5m2) in numpy alone: each value's bit
pattern as torch's ``Tensor.to`` rounds a float32 to it, for every kind of value an answer can hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from addnorm.model.quantize import NARROW_FLOATS, narrow_float_bits

FORMS = {
    "bfloat16": (torch.bfloat16, torch.int16, np.uint16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8, np.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8, np.uint8),
}


def values() -> np.ndarray:
    """Every magnitude a float32 answer takes (normalized vectors, hidden states, logits), and the edges of each
    form: its subnormals, the ties between two neighbours (odd and even), its largest value, the first values that
    round beyond it (e4m3fn saturates, e5m2 and bfloat16 reach infinity), float32's own subnormals, zeros of both
    signs. (Not NaN: an answer is finite, and torch's bfloat16 paths do not agree on its pattern.)"""
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(20_000) * 10.0 ** rng.integers(-12, 6, 20_000)
    edges = [0.0, -0.0, 1.0, 0.5, 448.0, 464.0, 479.9, 480.0, 1000.0, 57344.0, 61439.0, 61440.0, 65535.0]
    edges += [65536.0, 1e30, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 1.5 * 2.0**-9, 2.0**-14, 2.0**-16, 2.0**-17]
    edges += [3.0 * 2.0**-17, 2.0**-130, 1e-45, 3.4e38, float("inf")]
    # float32s exactly halfway between two neighbours of each form, on either parity: ties to even
    half = np.arange(0x3F800000, 0x3F800000 + (1 << 22), 1 << 15, dtype=np.uint32)
    ties = np.concatenate([half | 0x8000, half | 0x80000, half | 0x100000, half | 0x7FFF, half | 0x8001])
    all_ = np.concatenate([spread, edges, ties.view(np.float32) * 3.0, ties.view(np.float32)]).astype(
        np.float32
    )
    return np.concatenate([all_, -all_])


@pytest.mark.parametrize("form", NARROW_FLOATS)
def test_narrow_floats_are_torchs_bits(form):
    dtype, view, bits = FORMS[form]
    x = values()
    want = torch.from_numpy(x).to(dtype).view(view).numpy().view(bits)
    got = narrow_float_bits(x, form)
    assert got.dtype == bits and got.shape == x.shape
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in wrong[:10]]
    # shapes are kept (a token's rows), and the values a form holds exactly go through unchanged
    rows = x[:12].reshape(3, 4)
    assert narrow_float_bits(rows, form).shape == (3, 4)
    exact = torch.from_numpy(x).to(dtype).to(torch.float32).numpy()
    finite = np.isfinite(exact)
    np.testing.assert_array_equal(narrow_float_bits(exact[finite], form), want[finite])


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="form must be one of"):
        narrow_float_bits(np.ones(3, np.float32), "fp4")
