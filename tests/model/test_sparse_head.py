"""The sparse head (model.encoder.SparseHead): SPLADE's pooling of masked-LM logits, the torch module equal to the
float64 oracle (model/reference.py) for every pooling and activation SpladePooling has, padding never counted, and
its log1p exact where 1 + x rounds to 1 (where log(1 + x) would drop a term)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from addnorm.model import reference
from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.encoder import build_encoder, log1p


def _config(**fields) -> EncoderConfig:
    base = dict(d_model=32, nhead=4, dim_feedforward=48, num_layers=2, activation="gelu")
    return EncoderConfig(**{**base, "head": "sparse", "vocab_size": 50, "head_activation": "gelu", **fields})


@pytest.mark.parametrize("pooling, activation", [("max", "relu"), ("sum", "relu"), ("max", "log1p_relu")])
def test_the_sparse_head_equals_the_oracle_and_ignores_padding(pooling, activation):
    config = _config(sparse_pooling=pooling, sparse_activation=activation)
    encoder = build_encoder(config).double()
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:], mask[2, 2:] = True, True
    with torch.no_grad():
        got = encoder.outputs(x, mask)["sparse_weights"].numpy()
        garbage = x.clone()
        garbage[mask] = 1e3  # what lies under padding must not count
        again = encoder.outputs(garbage, mask)["sparse_weights"].numpy()
    weights = {k: v.numpy() for k, v in encoder.state_dict().items()}
    want = reference.outputs(config, weights, x.numpy(), mask.numpy())["sparse_weights"]
    assert got.shape == (3, 50) and (got >= 0).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(again, got, rtol=0, atol=1e-12)
    assert 0 < (got > 0).mean() < 1


def test_log1p_keeps_tiny_terms_that_log_of_one_plus_x_drops():
    x = torch.tensor([0.0, 1e-12, 3e-8, 1e-4, 0.5, 7.0, 1e6], dtype=torch.float32)
    got = log1p(x).double().numpy()
    want = np.log1p(x.double().numpy())
    assert torch.log(1 + x)[1].item() == 0.0  # the naive form loses the term
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)


def test_a_sparse_head_needs_its_vocabulary_and_a_masked_lm_activation():
    with pytest.raises(ConfigError, match="a sparse head needs the vocabulary's size"):
        _config(vocab_size=0)
    with pytest.raises(ConfigError, match="no other head takes one"):
        EncoderConfig(vocab_size=10)
    with pytest.raises(ConfigError, match="head_activation tanh is a classification head's"):
        _config(head_activation="tanh")
    with pytest.raises(ConfigError, match="sparse_pooling must be one of"):
        _config(sparse_pooling="mean")
    assert _config().run_tokens(8192) == 8192  # 50 terms a position: the server's limit holds
    assert _config(vocab_size=30522).run_tokens(8192) == 2198  # BERT's vocabulary: 256 MB of logits a run
