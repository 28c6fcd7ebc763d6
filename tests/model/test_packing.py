"""model/packing.py's cutting of a client-padded request into pieces and the putting back of its answer, for any
mask: rows of any lengths, padding inside a row or on its left, rows of padding only."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from addnorm.model.packing import answered, joined, pieces, real_lengths


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
@given(mask=masks(), most=st.integers(1, 8))
def test_pieces_hold_each_row_once_cut_to_their_longest_and_no_more_than_most(mask, most):
    lengths = real_lengths(mask)
    parts = pieces(mask, most)
    if parts is None:  # nothing to cut: every row keeps its whole length
        assert (lengths == mask.shape[1]).all()
        return
    rows = np.concatenate([r for r, _ in parts])
    assert sorted(rows.tolist()) == list(range(mask.shape[0])) and len(parts) <= most
    assert [n for _, n in parts] == sorted({n for _, n in parts}, reverse=True)  # longest first, one each
    for r, n in parts:
        assert lengths[r].max() == n  # cut to its longest row: only padding is cut off, and none is computed
    if len(np.unique(lengths)) <= most:  # every row with its own length's rows
        assert all((lengths[r] == n).all() for r, n in parts)
    for r in range(mask.shape[0]):
        assert mask[r, lengths[r] :].all() and (not mask[r, lengths[r] - 1] or mask[r].all())


def test_past_most_lengths_near_ones_share_a_piece():
    lengths = np.array([3, 50, 4, 48, 5, 20, 49])
    mask = np.arange(60)[None, :] >= lengths[:, None]
    got = [(r.tolist(), n) for r, n in pieces(mask, 3)]
    assert got == [([1, 3, 6], 50), ([5], 20), ([0, 2, 4], 5)]  # cut at the two widest gaps, 20->48 and 5->20


@settings(max_examples=300, deadline=None)
@given(mask=masks(), width=st.integers(1, 3), most=st.integers(1, 8))
def test_the_joined_answer_is_each_rows_own_and_zeros_beyond_its_length(mask, width, most):
    """With a model that answers its input (and a per-row output), the joined answer of the pieces is the request
    with zeros beyond each row's real length (a shorter row's padding within a piece too): what ``answered`` says
    the server answers."""
    x = np.random.default_rng(0).standard_normal((*mask.shape, width)).astype(np.float32) + 5.0  # never 0
    parts = pieces(mask, most) or [(np.arange(mask.shape[0]), mask.shape[1])]
    answers = [{"encoded": x[r, :n], "pooled": x[r, 0]} for r, n in parts]
    got = joined(mask, parts, answers)
    want = answered(x, mask)
    np.testing.assert_array_equal(got["encoded"], want)
    np.testing.assert_array_equal(got["pooled"], x[:, 0])
    beyond = np.arange(mask.shape[1])[None, :] >= real_lengths(mask)[:, None]
    assert not want[beyond].any() and want[~beyond].all()
    assert answered(x, None) is x
