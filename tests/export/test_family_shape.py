"""A new family is its module and the shared block's options (docs/architecture.md, "where each change goes").

The test family here is BERT but for one option no shipped family had: a gated feed-forward (ModernBERT's GLU, one
input projection twice as wide, its first half activated times its second). It is declared as a family module
declares one (a ``Family``: its key names and ``fields``); the shared block (model/encoder.py), the numpy oracle
(model/reference.py) and the export take the option from EncoderConfig. The answers are transformers' own modules:
BERT's attention and LayerNorms and ModernBERT's ``ModernBertMLP``, on the checkpoint's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from addnorm.export import cli, families
from addnorm.export.families import Family, bert
from addnorm.model import reference
from addnorm.model.artifact import WEIGHTS_FILE, Manifest
from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.encoder import build_encoder
from addnorm.model.verdict import float32_floor

pytestmark = pytest.mark.export
E, HEADS, FF, LAYERS = 32, 4, 48, 2

GATED_BERT = Family(
    "GatedBERT",
    ("gated-bert",),
    bert.BERT_LAYER_KEYS,
    bert.BERT_QKV,
    bert.BERT_EMBEDDINGS,
    # config.json says it (as a real family's would): what the weights' shape is read with, too (Family.shape)
    fields=lambda config: {
        **bert.fields(config),
        "feed_forward": "gated" if config.get("gated_mlp") else "plain",
    },
    text=bert.text,
)


@pytest.fixture
def with_gated_family(monkeypatch):
    shipped = families.families()
    monkeypatch.setattr(families, "families", lambda: [*shipped, GATED_BERT])


def _transformers_layers(seed: int = 0):
    """Two layers of BERT's attention and LayerNorms with ModernBERT's gated MLP, transformers' modules."""
    import transformers as tf
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    shape = dict(hidden_size=E, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS)
    torch.manual_seed(seed)
    model = tf.BertModel(tf.BertConfig(**shape, hidden_act="gelu", attn_implementation="eager")).eval()
    mlp_config = tf.ModernBertConfig(
        hidden_size=E, intermediate_size=FF, hidden_activation="gelu", mlp_bias=True, mlp_dropout=0.0
    )
    mlps = [ModernBertMLP(mlp_config).eval() for _ in range(LAYERS)]
    with torch.no_grad():  # LayerNorms away from 1 and 0: a swapped gamma shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model, mlps


def _expected(model, mlps, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        for layer, mlp in zip(model.encoder.layer, mlps, strict=True):
            h = layer.attention(x)[0]
            x = layer.output.LayerNorm(h + mlp(h))
    return x.numpy()


def _checkpoint(model, mlps, directory: Path) -> Path:
    """The model directory a gated-BERT checkpoint would be: BERT's keys, the MLP's in intermediate / output."""
    from safetensors.torch import save_file

    state = {f"bert.{k}": v.contiguous() for k, v in model.state_dict().items()}
    for i, mlp in enumerate(mlps):
        prefix = f"bert.encoder.layer.{i}."
        state[f"{prefix}intermediate.dense.weight"] = mlp.Wi.weight.detach().contiguous()
        state[f"{prefix}intermediate.dense.bias"] = mlp.Wi.bias.detach().contiguous()
        state[f"{prefix}output.dense.weight"] = mlp.Wo.weight.detach().contiguous()
        state[f"{prefix}output.dense.bias"] = mlp.Wo.bias.detach().contiguous()
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"))
    config = {
        "model_type": "gated-bert",
        "hidden_size": E,
        "num_attention_heads": HEADS,
        "intermediate_size": FF,
        "num_hidden_layers": LAYERS,
        "hidden_act": "gelu",
        "gated_mlp": True,
        "layer_norm_eps": 1e-12,
        "vocab_size": model.config.vocab_size,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_shared_blocks_gated_feed_forward_is_modernberts_mlp():
    model, mlps = _transformers_layers()
    config = EncoderConfig(
        d_model=E, nhead=HEADS, dim_feedforward=FF, activation="gelu", feed_forward="gated"
    )
    block = build_encoder(config).layers[0]
    with torch.no_grad():
        block.linear1.weight.copy_(mlps[0].Wi.weight)
        block.linear1.bias.copy_(mlps[0].Wi.bias)
        block.linear2.weight.copy_(mlps[0].Wo.weight)
        block.linear2.bias.copy_(mlps[0].Wo.bias)
        x = torch.randn(3, 5, E)
        got, want = block.feed_forward(x), mlps[0](x)
    assert block.linear1.weight.shape == (2 * FF, E)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_oracle_computes_the_gated_block_as_torch(norm_first):
    config = EncoderConfig(
        d_model=E,
        nhead=HEADS,
        dim_feedforward=FF,
        num_layers=LAYERS,
        activation="gelu",
        feed_forward="gated",
        norm_first=norm_first,
    )
    encoder = build_encoder(config, seed=3)
    x, mask = torch.randn(2, 7, E), torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 4:] = True
    with torch.no_grad():
        got = encoder.double()(x.double(), mask).numpy()
    weights = {k: v.numpy() for k, v in encoder.state_dict().items()}
    want = reference.forward(config, weights, x.double().numpy(), mask.numpy())
    assert np.abs(got - want)[~mask.numpy()].max() < 1e-12
    swapped = dict(weights)  # input and gate the other way round: the halves' order is part of the math
    for name in ("weight", "bias"):
        w = weights[f"layers.0.linear1.{name}"]
        swapped[f"layers.0.linear1.{name}"] = np.concatenate([w[FF:], w[:FF]])
    other = reference.forward(config, swapped, x.double().numpy(), mask.numpy())
    assert np.abs(other - want).max() > 1e-2


def test_a_gated_family_exports_from_its_module_alone(with_gated_family, tmp_path, capsys):
    model, mlps = _transformers_layers(seed=1)
    directory = _checkpoint(model, mlps, tmp_path / "gated-bert")
    out = tmp_path / "artifact"
    assert cli.main(["--from", str(directory), "--artifact", str(out), "-q"]) == 0, capsys.readouterr().err
    manifest = Manifest.load(out)
    config = manifest.config
    assert (config.feed_forward, config.dim_feedforward, config.num_layers) == ("gated", FF, LAYERS)
    assert manifest.parity["passed"]

    import onnxruntime as ort

    x = torch.randn(2, 9, E)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["encoded"], {"embeddings": x.numpy(), "mask": np.zeros((2, 9), bool)})[0]
    want = _expected(model, mlps, x)
    assert np.abs(got - want).max() <= 4 * max(float32_floor(want), 1e-6), np.abs(got - want).max()
    weights = reference.load_weights(out / WEIGHTS_FILE)
    assert weights["layers.0.linear1.weight"].shape == (2 * FF, E)


def test_a_gated_checkpoint_whose_projection_is_not_two_halves_is_refused(
    with_gated_family, tmp_path, capsys
):
    model, mlps = _transformers_layers()
    for mlp in mlps:
        mlp.Wi = torch.nn.Linear(E, 2 * FF + 1)
    directory = _checkpoint(model, mlps, tmp_path / "odd")
    assert cli.main(["--from", str(directory), "--artifact", str(tmp_path / "a"), "-q"]) == 2
    assert "not input and gate" in capsys.readouterr().err


def test_an_unknown_feed_forward_is_a_config_error():
    with pytest.raises(ConfigError, match="feed_forward must be one of"):
        EncoderConfig(feed_forward="swiglu")
