"""MPNet's relative position bias (model/attention.py, model/encoder.py, model/reference.py): the buckets are
transformers' own, the stack equals transformers' MPNetEncoder past the largest distance it tells apart (128), the
numpy oracle equals torch in float64, and the packed form answers as the padded one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from addnorm.model.attention import RELATIVE_MAX_DISTANCE, relative_buckets
from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.encoder import Packing, build_encoder
from addnorm.model.reference import outputs as reference_outputs

transformers = pytest.importorskip("transformers")


def test_the_buckets_are_transformers_own_at_every_distance():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    distances = torch.arange(-700, 701)
    want = MPNetEncoder.relative_position_bucket(distances).tolist()
    table = relative_buckets()
    clipped = distances.clamp(-RELATIVE_MAX_DISTANCE, RELATIVE_MAX_DISTANCE) + RELATIVE_MAX_DISTANCE
    assert [table[i] for i in clipped.tolist()] == want
    assert sorted(set(table)) == [b for b in range(32) if b != 16]  # every bucket but "after, distance 0"


def _tiny_mpnet(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.MPNetConfig(
        vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=514, hidden_act="gelu",
    )  # fmt: skip
    model = transformers.MPNetModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)  # a wrong bucket moves attention
    return model


def test_the_stack_equals_transformers_mpnet_encoder_past_the_largest_distance(tmp_path):
    from addnorm.export.families import family_of

    model = _tiny_mpnet()
    family = family_of(json.loads(model.config.to_json_string()))
    assert family.name == "MPNet"
    fields = family.fields(model.config.to_dict())
    config = EncoderConfig(**fields, dropout=0.0)
    ours = build_encoder(config)
    ours.load_state_dict(family.block_state(model.state_dict()), strict=True)
    rng = np.random.default_rng(0)
    seq = 2 * RELATIVE_MAX_DISTANCE + 44  # distances up to 299: every bucket, the last ones saturated
    x = torch.from_numpy(rng.standard_normal((2, seq, 32)).astype(np.float32))
    mask = torch.zeros(2, seq, dtype=torch.bool)
    mask[1, 150:] = True
    # transformers' additive mask: the least float32 on padded keys
    extended = torch.zeros(2, 1, 1, seq).masked_fill(mask[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model.encoder(x, attention_mask=extended)[0]
        got = ours(x, mask)
    keep = ~mask
    assert float((got - want).abs()[keep].max()) < 2e-5
    # and the bias matters: without it the answer moves far past that
    with torch.no_grad():
        ours.relative_attention_bias.weight.zero_()
        assert float((ours(x, mask) - want).abs()[keep].max()) > 1e-3


@pytest.mark.parametrize("layers", [1, 2])
def test_the_numpy_oracle_and_the_packed_form_equal_torch(layers):
    config = EncoderConfig(
        d_model=32, nhead=4, dim_feedforward=48, dropout=0.0, activation="gelu", num_layers=layers,
        relative_attention_buckets=32, pooling="mean",
    )  # fmt: skip
    enc = build_encoder(config, seed=5).double()
    weights = {k: v.detach().numpy() for k, v in enc.state_dict().items()}
    assert "relative_attention_bias.weight" in weights
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 140, 32)) * 2.0
    mask = np.zeros((3, 140), bool)
    mask[1, 20:] = True
    mask[2, :] = True  # all padding: uniform attention, as without a bias
    with torch.no_grad():
        want = enc.outputs(torch.from_numpy(x), torch.from_numpy(mask))
    got = reference_outputs(config, weights, x, mask)
    for name, value in want.items():
        assert np.abs(got[name] - value.numpy()).max() < 1e-12, name

    # packed: rows 0 and 1 end to end at their own lengths (140 and 20)
    lengths = torch.tensor([140, 20])
    tokens = torch.cat([torch.from_numpy(x[0]), torch.from_numpy(x[1, :20])])[None]
    packing = Packing(torch.tensor([0, 140]), lengths, 140, torch.zeros(160, dtype=torch.bool))
    with torch.no_grad():
        packed = enc.packed_outputs(tokens, packing)
        padded = enc.outputs(torch.from_numpy(x[:2]), torch.from_numpy(mask[:2]))
    assert float((packed["encoded"][0] - padded["encoded"][0]).abs().max()) < 1e-12
    assert float((packed["encoded"][1, :20] - padded["encoded"][1, :20]).abs().max()) < 1e-12


def test_the_config_takes_no_or_a_multiple_of_four_buckets():
    assert EncoderConfig(relative_attention_buckets=0).relative_attention_buckets == 0
    for bad in (-4, 6, True, 2.0):
        with pytest.raises(ConfigError, match="relative_attention_buckets"):
            EncoderConfig(relative_attention_buckets=bad)


def test_a_config_with_other_buckets_than_transformers_computes_is_refused():
    from addnorm.export.families import mpnet

    with pytest.raises(ConfigError, match="relative_attention_num_buckets 16"):
        mpnet.fields({"relative_attention_num_buckets": 16, "hidden_size": 32})
