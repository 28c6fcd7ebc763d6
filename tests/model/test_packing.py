"""model/packing.py's cutting of a client-padded request into pieces and the putting back of its answer, for any
mask: rows of any lengths, padding inside a row or on its left, rows of padding only."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from model.packing import answered, joined, pieces, real_lengths


@st.composite
def masks(draw) -> np.ndarray:
    """(B, S) masks, true = padding: each row a real length (0: all padding) padded on the right, and sometimes
    padding inside its real part too."""
    rows, seq = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    mask = np.zeros((rows, seq), bool)
    for r in range(rows):
        mask[r, draw(st.integers(0, seq)) :] = True
        inside = draw(st.lists(st.integers(0, seq - 1), max_size=3))
        mask[r, inside] = True
    return mask


@settings(max_examples=300, deadline=None)
@given(mask=masks())
def test_pieces_cover_the_rows_in_order_each_cut_to_its_rows_real_length(mask):
    lengths = real_lengths(mask)
    parts = pieces(mask)
    if parts is None:  # nothing to cut: every row keeps its whole length
        assert (lengths == mask.shape[1]).all()
        return
    assert parts[0][0] == 0 and parts[-1][1] == mask.shape[0]
    for (a, b, n), after in zip(parts, [*parts[1:], None], strict=True):
        assert a < b and (lengths[a:b] == n).all() and 1 <= n <= mask.shape[1]
        for r in range(a, b):
            assert mask[r, n:].all()  # only padding is cut off
            assert not mask[r, n - 1] or mask[r].all()  # and all of it (a row of padding only stays whole)
        if after is not None:
            assert after[0] == b and after[2] != n  # a new piece only where the length changes


@settings(max_examples=300, deadline=None)
@given(mask=masks(), width=st.integers(1, 3))
def test_the_joined_answer_is_each_rows_own_and_zeros_beyond_its_length(mask, width):
    """With a model that answers its input (and a per-row output), the joined answer of the pieces is the request
    with zeros beyond each row's real length: what ``answered`` says the server answers."""
    x = np.random.default_rng(0).standard_normal((*mask.shape, width)).astype(np.float32) + 5.0  # never 0
    parts = pieces(mask) or [(0, mask.shape[0], mask.shape[1])]
    answers = [{"encoded": x[a:b, :n], "pooled": x[a:b, 0]} for a, b, n in parts]
    got = joined(*mask.shape, parts, answers)
    want = answered(x, mask)
    np.testing.assert_array_equal(got["encoded"], want)
    np.testing.assert_array_equal(got["pooled"], x[:, 0])
    beyond = np.arange(mask.shape[1])[None, :] >= real_lengths(mask)[:, None]
    assert not want[beyond].any() and want[~beyond].all()
    assert answered(x, None) is x
