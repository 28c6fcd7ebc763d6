"""The classification head (model.encoder.ClassificationHead): ``out(activation(dense(first token)))`` with each
activation a family's head has (BERT's tanh, DistilBERT's relu, ELECTRA's exact GELU), the torch module and the
float64 oracle (model/reference.py) each equal to the head written out by hand here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from addnorm.model import reference
from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import build_encoder

BY_HAND = {"tanh": torch.tanh, "relu": torch.relu, "gelu": lambda h: F.gelu(h, approximate="none")}


@pytest.mark.unit
@pytest.mark.parametrize("activation", sorted(BY_HAND))
def test_the_classification_head_computes_its_activation(activation):
    config = EncoderConfig(
        d_model=32,
        nhead=4,
        dim_feedforward=48,
        num_layers=1,
        head="classify",
        num_labels=3,
        head_activation=activation,
    )
    encoder = build_encoder(config).double().eval()
    x = torch.randn(4, 6, 32, dtype=torch.float64)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1, 4:] = True
    with torch.no_grad():
        out = encoder.outputs(x, mask)
        first = out["encoded"][:, 0]
        head = encoder.head
        want = (
            BY_HAND[activation](first @ head.dense.weight.T + head.dense.bias) @ head.out.weight.T
            + head.out.bias
        )
    got = out["scores"].numpy()
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-12)
    weights = {k: v.numpy() for k, v in encoder.state_dict().items()}
    oracle = reference.outputs(config, weights, x.numpy(), mask.numpy())["scores"]
    np.testing.assert_allclose(oracle, want.numpy(), rtol=0, atol=1e-10)
    # the three differ on these inputs: a head computing another's activation cannot pass
    others = [BY_HAND[a](first @ head.dense.weight.T + head.dense.bias) for a in BY_HAND if a != activation]
    mine = BY_HAND[activation](first @ head.dense.weight.T + head.dense.bias)
    assert all(float((mine - o).abs().max()) > 1e-3 for o in others)
