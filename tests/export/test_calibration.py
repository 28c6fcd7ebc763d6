"""--calibration FILE (export/calibration.py): each format a user has, and a clear error for each mistake."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from addnorm.export.calibration import calibration_cases, load_arrays
from addnorm.model.config import ConfigError

pytestmark = pytest.mark.unit


def _x(n=5, s=7, e=16):
    return np.random.default_rng(0).standard_normal((n, s, e)).astype(np.float32)


def test_npy_npz_and_safetensors_with_lengths_or_mask(tmp_path):
    x = _x()
    np.save(tmp_path / "a.npy", x)
    got, mask = load_arrays(tmp_path / "a.npy")
    assert np.array_equal(got, x) and not mask.any()
    lengths = np.array([7, 3, 1, 5, 7])
    np.savez(tmp_path / "b.npz", embeddings=x, lengths=lengths)
    _, mask = load_arrays(tmp_path / "b.npz")
    assert list((~mask).sum(1)) == list(lengths)
    save_file({"embeddings": x, "mask": mask}, str(tmp_path / "c.safetensors"))
    _, again = load_arrays(tmp_path / "c.safetensors")
    assert np.array_equal(again, mask)


def test_cases_group_like_lengths_and_cut_to_the_longest(tmp_path):
    x = np.concatenate([_x(n=10, s=20)])
    lengths = np.array([20, 2, 3, 2, 19, 4, 2, 2, 3, 2])
    mask = np.arange(20)[None, :] >= lengths[:, None]
    cases = calibration_cases(x, mask, 16)
    assert [(c.batch, c.seq) for c in cases] == [(8, 4), (2, 20)]
    rng = np.random.default_rng(0)
    got, got_mask = cases[0].make(16, rng)
    assert got.shape == (8, 4, 16) and got_mask.shape == (8, 4) and cases[0].representative


@pytest.mark.parametrize(
    "arrays, want",
    [
        ({"embeddings": np.zeros((2, 3), np.float32)}, "must be float \\[N, S, E\\]"),
        ({"embeddings": np.full((1, 2, 16), np.nan, np.float32)}, "NaN"),
        ({"x": np.zeros((1, 2, 16), np.float32)}, "no 'embeddings' array"),
        ({"embeddings": np.zeros((2, 3, 16), np.float32), "lengths": np.array([0, 3])}, "'lengths' must be"),
        ({"embeddings": np.zeros((2, 3, 16), np.float32), "mask": np.ones((2, 3), bool)}, "all padding"),
        ({"embeddings": np.zeros((2, 3, 16), np.float32), "mask": np.zeros((2, 4), bool)}, "'mask' must be"),
    ],
)
def test_each_mistake_is_one_clear_error(tmp_path, arrays, want):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConfigError, match=want):
        load_arrays(tmp_path / "bad.npz")


def test_wrong_width_text_without_a_tokenizer_and_unknown_formats(tmp_path):
    np.save(tmp_path / "a.npy", _x(e=8))
    x, mask = load_arrays(tmp_path / "a.npy")
    with pytest.raises(ConfigError, match="8 wide; the model's d_model is 16"):
        calibration_cases(x, mask, 16)
    (tmp_path / "s.txt").write_text("a sentence\n")
    with pytest.raises(ConfigError, match="tokenizer"):
        load_arrays(tmp_path / "s.txt")
    (tmp_path / "a.csv").write_text("1,2\n")
    with pytest.raises(ConfigError, match="expected .npy"):
        load_arrays(tmp_path / "a.csv")
    with pytest.raises(ConfigError, match="does not exist"):
        load_arrays(tmp_path / "missing.npy")
