"""Hugging Face model directories (export/model_dir.py): what config.json says, and what it refuses."""

import json

import pytest
import torch
from safetensors.torch import save_file

from addnorm.export import agreement, model_dir
from addnorm.export.weights import CheckpointError
from addnorm.model.config import ConfigError

pytestmark = pytest.mark.unit

MINILM = {
    "hidden_size": 384,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}


def test_config_json_gives_the_block_its_shape():
    fields = model_dir.config_fields(MINILM)
    assert fields == {
        "d_model": 384,
        "nhead": 12,
        "dim_feedforward": 1536,
        "num_layers": 6,
        "layer_norm_eps": 1e-12,
        "activation": "gelu",
        "norm_first": False,
    }
    assert model_dir.contradictions(fields, {"nhead": 8, "d_model": 384, "activation": None}) == [
        "--nhead 8 (config.json: 12)"
    ]


@pytest.mark.parametrize(
    "change, want",
    [({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"), ({"is_decoder": True}, "describes a decoder")],
)
def test_what_the_block_cannot_compute_is_refused(change, want):
    with pytest.raises(ConfigError, match=want):
        model_dir.config_fields({**MINILM, **change})


def test_a_directory_a_file_beside_config_json_and_what_is_missing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(CheckpointError, match="holds none of model.safetensors"):
        model_dir.locate(model)
    save_file({"w": torch.zeros(1)}, str(model / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has no config.json"):
        model_dir.locate(model)
    (model / "config.json").write_text(json.dumps(MINILM))
    assert model_dir.locate(model) == model_dir.ModelDir(model / "model.safetensors", model)
    assert model_dir.locate(model / "model.safetensors").directory == model  # its config.json is read too
    alone = tmp_path / "alone.safetensors"
    save_file({"w": torch.zeros(1)}, str(alone))
    assert model_dir.locate(alone).directory is None and model_dir.locate(alone).config is None
    with pytest.raises(CheckpointError, match="does not exist"):
        model_dir.locate(tmp_path / "nowhere")


def test_sentence_measures():
    """Mean pooling reads real tokens only: padding that differs wildly changes no measure."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((4, 5, 8))
    mask = np.zeros((4, 5), bool)
    mask[1, 3:] = True
    noisy = x.copy()
    noisy[1, 3:] = 1e6  # padding: never read
    assert np.allclose(agreement.sentence_cosines(noisy, x, mask), 1.0)
    agree = agreement.agreement(noisy, x, mask)
    assert agree.max_abs == 0.0 and agree.tokens == 18 and abs(agree.spearman - 1) < 1e-12


def _pipeline(directory, modules: list[str], pooling: dict) -> None:
    (directory / "1_Pooling").mkdir(parents=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    entries = [
        {"idx": i, "name": str(i), "path": "1_Pooling" if kind == "Pooling" else "",
         "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(modules)
    ]  # fmt: skip
    (directory / "modules.json").write_text(json.dumps(entries))


@pytest.mark.parametrize(
    "modules, pooling, want",
    [
        (["Transformer", "Pooling", "Normalize"], {"pooling_mode_mean_tokens": True}, ("mean", True)),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
            ("cls", False),
        ),
        (["Normalize", "Transformer", "Pooling"], {"pooling_mode_mean_tokens": True}, ("mean", False)),
        (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, None),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            None,
        ),
    ],
)
def test_a_sentence_transformers_directory_gives_its_pooling(tmp_path, caplog, modules, pooling, want):
    """modules.json's Pooling (1_Pooling/config.json) and a Normalize after it; a mode the graph does not compute
    leaves the pooled output out, and says so."""
    _pipeline(tmp_path, modules, pooling)
    got = model_dir.sentence_pooling(tmp_path)
    if want is None:
        assert got == {} and "no pooled output" in caplog.text
    else:
        assert got == {"pooling": want[0], "normalize_pooled": want[1]}


def test_a_plain_bert_directory_has_no_pooling(tmp_path):
    assert model_dir.sentence_pooling(tmp_path) == {} and model_dir.sentence_pooling(None) == {}
    (tmp_path / "modules.json").write_text("not json")
    assert model_dir.sentence_pooling(tmp_path) == {}
