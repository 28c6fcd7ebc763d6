"""/v1 decoding: every bad input is a 4xx ServiceError naming the problem."""

import io

import numpy as np
import orjson
import pytest

from addnorm.service.errors import NotAcceptable, ServiceError, TooLarge, UnsupportedMediaType, http_status
from addnorm.service.protocols.v1 import codec as codec_v1

D = 4
MAX = 1000


def decode(doc, raw: bytes | None = None, content_type="application/json", headers=None):
    body = raw if raw is not None else orjson.dumps(doc)
    return codec_v1.decode(content_type, body, headers, D, MAX)


def row(n=D, v=0.5):
    return [v] * n


def test_single_sequence_is_batched_and_squeezed_back():
    req = decode({"embeddings": [row(), row()]})
    assert req.embeddings.shape == (1, 2, D) and req.embeddings.dtype == np.float32 and req.squeeze
    assert req.split(np.zeros((1, 2, D))).shape == (2, D)


def test_batch_with_mask():
    req = decode({"embeddings": [[row(), row()], [row(), row()]], "mask": [[False, False], [False, True]]})
    assert req.embeddings.shape == (2, 2, D) and req.mask.tolist() == [[False, False], [False, True]]


def test_sequences_of_different_lengths_are_padded_masked_and_cut_back():
    req = decode({"embeddings": [[row()], [row(), row(), row()]]})
    assert req.embeddings.shape == (2, 3, D)
    assert req.mask.tolist() == [[False, True, True], [False, False, False]]
    parts = req.split(np.ones((2, 3, D)))
    assert [p.shape for p in parts] == [(1, D), (3, D)]


def test_integers_are_numbers():
    assert decode({"embeddings": [[1, 2, 3, 4]]}).embeddings.dtype == np.float32


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"embeddings": [row(3)]}, "last dimension is 3 but the model's d_model is 4"),
        ({"embeddings": [[[[0.0]]]]}, "nesting"),
        ({"embeddings": 1.0}, "non-empty array"),
        ({"embeddings": [row(), row(3)]}, "ragged"),
        ({"embeddings": [[row(), row(3)], [row()]]}, "ragged"),
        ({"embeddings": [[row()], [row(3)]]}, "has 3 features"),
        ({"embeddings": [[row()], []]}, r"embeddings\[1\] must be a non-empty"),
        ({"embeddings": [["a", "b", "c", "d"]]}, "only numbers, found strings"),
        ({"embeddings": [[0.0, 1.0, True, 0.0]]}, "only numbers"),
        ({"embeddings": [[0.0, None, 0.0, 0.0]]}, "only numbers"),
        ({"embeddings": [[0.0, False, 0.0, 0.0]]}, "found true, false or null"),  # numpy reads it as 0
        ({"embeddings": [[0.0, True, 0.0, 0.0]], "mask": [False]}, "found true, false or null"),
        ({"embeddings": [[0.0, {"a": 1}, 0.0, 0.0]]}, "non-numbers"),
        ({"embeddings": []}, "non-empty"),
        ({"embeddings": [[]]}, "last dimension is 0"),
        ({"embeddings": [row(v=1e39)]}, "finite"),
        ({"embedding": [row()]}, "unknown field"),
        ({"mask": [True]}, "missing field 'embeddings'"),
        ([1, 2], "JSON object"),
        ({"embeddings": [row()], "mask": [1]}, "true/false"),
        ({"embeddings": [row(), row()], "mask": [False]}, "mask shape"),
        ({"embeddings": [[row()], [row(), row()]], "mask": [[False], [False, False]]}, "mask"),
        ({"embeddings": [row()], "mask": "yes"}, "mask must be"),
    ],
)
def test_bad_json_inputs(doc, message):
    with pytest.raises(ServiceError, match=message) as info:
        decode(doc)
    assert 400 <= http_status(info.value) < 500


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "empty"),
        (b"{", "malformed JSON"),
        (b'{"embeddings": [[NaN, 0, 0, 0]]}', "NaN and Infinity"),
        (b'{"embeddings": [[Infinity, 0, 0, 0]]}', "NaN and Infinity"),
        (b"\xff\xfe", "malformed JSON"),
    ],
)
def test_malformed_bodies(raw, message):
    with pytest.raises(ServiceError, match=message):
        decode(None, raw=raw)


def test_too_many_elements_is_413():
    with pytest.raises(TooLarge, match="limit of 1000"):
        decode({"embeddings": [[row()] * 300]})


def test_binary_raw_float32_with_shape_header():
    x = np.arange(2 * 3 * D, dtype="<f4").reshape(2, 3, D)
    req = decode(
        None,
        raw=x.tobytes(),
        content_type="application/octet-stream",
        headers={"x-shape": "2,3,4", "x-lengths": "3,1"},
    )
    np.testing.assert_array_equal(req.embeddings, x)
    assert req.mask.tolist() == [[False, False, False], [False, True, True]]


@pytest.mark.parametrize(
    ("headers", "nbytes", "message"),
    [
        ({}, 48, "X-Shape header"),
        ({"x-shape": "a,b"}, 48, "integers"),
        ({"x-shape": "1,3,4"}, 40, "needs 48"),
        ({"x-shape": "0,3,4"}, 0, "positive"),
        ({"x-shape": "1,3,4", "x-lengths": "5"}, 48, "X-Lengths"),
    ],
)
def test_bad_binary_inputs(headers, nbytes, message):
    with pytest.raises(ServiceError, match=message):
        decode(None, raw=b"\0" * nbytes, content_type="application/octet-stream", headers=headers)


def test_npy_body():
    buf = io.BytesIO()
    np.save(buf, np.ones((3, D), dtype=np.float64))
    req = decode(None, raw=buf.getvalue(), content_type="application/x-npy")
    assert req.embeddings.shape == (1, 3, D) and req.embeddings.dtype == np.float32
    with pytest.raises(ServiceError, match="npy"):
        decode(None, raw=b"garbage", content_type="application/x-npy")


def test_media_types():
    with pytest.raises(UnsupportedMediaType):
        decode(None, raw=b"x", content_type="text/csv")
    assert codec_v1.negotiate(None) == codec_v1.JSON
    assert codec_v1.negotiate("application/x-npy, */*") == codec_v1.NPY
    with pytest.raises(NotAcceptable):
        codec_v1.negotiate("text/html")


def test_json_response_has_no_python_lists_and_round_trips():
    out = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    doc = orjson.loads(codec_v1.encode_json({"encoded": out}, "encoder"))
    assert doc["shape"] == [2, 3] and doc["model"] == "encoder"
    np.testing.assert_array_equal(np.array(doc["encoded"], dtype=np.float32), out)


def test_oversized_json_is_refused_before_parsing():
    body = b'{"embeddings": [[' + b"0," * 5000 + b"0]]}"
    with pytest.raises(TooLarge, match="more than 1000 values"):
        codec_v1.decode("application/json", body, None, D, MAX)
