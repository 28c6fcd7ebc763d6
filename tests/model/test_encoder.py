"""The torch block: Add & Norm semantics, and equality with PyTorch's own layers on copied weights."""

import pytest
import torch
from torch import nn

from addnorm.model.config import EncoderConfig
from addnorm.model.encoder import AddNorm, Encoder, EncoderBlock, build_encoder

EXACT_ATOL = 1e-6  # same math, different kernels


def test_post_norm_is_layer_norm_of_the_residual_sum():
    x = torch.randn(2, 5, 8)
    add_norm = AddNorm(8)
    f = nn.Linear(8, 8)
    with torch.no_grad():
        expected = nn.functional.layer_norm(x + f(x), (8,), add_norm.weight, add_norm.bias, 1e-5)
        assert torch.allclose(add_norm(x, f), expected, atol=EXACT_ATOL)


def test_pre_norm_adds_the_sublayer_of_the_normalized_input():
    x = torch.randn(2, 5, 8)
    add_norm = AddNorm(8, norm_first=True)
    f = nn.Linear(8, 8)
    with torch.no_grad():
        expected = x + f(nn.functional.layer_norm(x, (8,), add_norm.weight, add_norm.bias, 1e-5))
        assert torch.allclose(add_norm(x, f), expected, atol=EXACT_ATOL)


def test_add_norm_params_are_layer_norm_params():
    assert set(dict(AddNorm(8).named_parameters())) == {"weight", "bias"}


def _mask(b: int, s: int) -> torch.Tensor:
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[1, s // 2 :] = True
    return mask


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_block_equals_torch_transformer_encoder_layer(norm_first, activation):
    cfg = EncoderConfig(
        d_model=64, nhead=4, dim_feedforward=128, norm_first=norm_first, activation=activation
    )
    ref = nn.TransformerEncoderLayer(
        64, 4, 128, activation=activation, norm_first=norm_first, batch_first=True
    )
    ref.eval()
    block = EncoderBlock(cfg).eval()
    assert block.state_dict().keys() == ref.state_dict().keys()
    block.load_state_dict(ref.state_dict())  # strict: identical names and shapes
    x, mask = torch.randn(3, 7, 64), _mask(3, 7)
    with torch.no_grad():
        torch.testing.assert_close(block(x, mask), ref(x, src_key_padding_mask=mask), atol=EXACT_ATOL, rtol=0)
        torch.testing.assert_close(block(x), ref(x), atol=EXACT_ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_stack_equals_torch_transformer_encoder(norm_first):
    cfg = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, num_layers=3, norm_first=norm_first)
    layer = nn.TransformerEncoderLayer(32, 4, 64, norm_first=norm_first, batch_first=True)
    ref = nn.TransformerEncoder(
        layer, 3, norm=nn.LayerNorm(32) if norm_first else None, enable_nested_tensor=False
    )
    ref.eval()
    enc = Encoder(cfg).eval()
    assert enc.state_dict().keys() == ref.state_dict().keys()
    enc.load_state_dict(ref.state_dict())
    x, mask = torch.randn(2, 6, 32), _mask(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(enc(x, mask), ref(x, src_key_padding_mask=mask), atol=EXACT_ATOL, rtol=0)


def test_sequence_first_layout_matches_batch_first():
    cfg = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64)
    bf = build_encoder(cfg, seed=3)
    sf = build_encoder(EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, batch_first=False), seed=3)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(sf(x.transpose(0, 1)).transpose(0, 1), bf(x), atol=EXACT_ATOL, rtol=0)


def test_steps_collects_every_add_norm_result():
    enc = build_encoder(EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, num_layers=2, norm_first=True))
    steps: list[torch.Tensor] = []
    with torch.no_grad():
        out = enc(torch.randn(1, 4, 32), None, steps)
    assert len(steps) == enc.config.num_norms == 5
    assert torch.equal(steps[-1], out)


def test_all_padding_row_is_finite():
    enc = build_encoder(EncoderConfig(d_model=32, nhead=4, dim_feedforward=64))
    mask = torch.ones(1, 4, dtype=torch.bool)
    with torch.no_grad():
        assert torch.isfinite(enc(torch.randn(1, 4, 32), mask)).all()


def test_seeded_init_is_deterministic():
    cfg = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64)
    a, b, c = build_encoder(cfg, seed=7), build_encoder(cfg, seed=7), build_encoder(cfg, seed=8)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(
        a.state_dict()["layers.0.linear1.weight"], c.state_dict()["layers.0.linear1.weight"]
    )
