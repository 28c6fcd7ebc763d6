import pytest

from addnorm.model.config import ConfigError, EncoderConfig


def test_defaults_match_the_spec():
    c = EncoderConfig()
    assert (c.d_model, c.nhead, c.dim_feedforward, c.num_layers) == (768, 12, 3072, 1)
    assert (c.norm_first, c.layer_norm_eps, c.activation, c.batch_first) == (False, 1e-5, "relu", True)
    assert c.head_dim == 64


def test_json_round_trip():
    c = EncoderConfig(d_model=64, nhead=8, num_layers=3, norm_first=True, activation="gelu")
    assert EncoderConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"d_model": 10, "nhead": 3}, "divisible by nhead"),
        ({"d_model": 0}, "d_model must be a positive integer"),
        ({"num_layers": -1}, "num_layers must be a positive integer"),
        ({"dim_feedforward": 2.5}, "dim_feedforward must be a positive integer"),
        ({"activation": "swish"}, "activation must be one of"),
        ({"dropout": 1.0}, "dropout must be a number in [0, 1)"),
        ({"dropout": -0.1}, "dropout must be a number in [0, 1)"),
        ({"layer_norm_eps": 0}, "layer_norm_eps"),
        ({"norm_first": "yes"}, "norm_first must be true or false"),
        ({"norm": "batch"}, "norm must be one of"),
    ],
)
def test_invalid_configs_name_the_problem(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        EncoderConfig(**fields)


def test_unknown_fields_and_bad_json_are_rejected():
    with pytest.raises(ConfigError, match="unknown config field"):
        EncoderConfig.from_dict({"d_model": 64, "heads": 4})
    with pytest.raises(ConfigError, match="not valid JSON"):
        EncoderConfig.from_json("{")


def test_num_norms_counts_add_norm_steps():
    assert EncoderConfig(num_layers=1).num_norms == 2
    assert EncoderConfig(num_layers=6).num_norms == 12
    assert EncoderConfig(num_layers=6, norm_first=True).num_norms == 13
