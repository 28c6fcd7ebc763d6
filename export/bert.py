"""Weights of Hugging Face ``BertLayer``s (post-norm, GELU, eps 1e-12) mapped onto the encoder's names."""

from __future__ import annotations

import re

import torch

from export.weights import CheckpointError

# BertLayer key (after its "…layer.{i}." prefix) -> encoder block key; q/k/v are stacked into in_proj.
_DIRECT = {
    "attention.output.dense.weight": "self_attn.out_proj.weight",
    "attention.output.dense.bias": "self_attn.out_proj.bias",
    "attention.output.LayerNorm.weight": "norm1.weight",
    "attention.output.LayerNorm.bias": "norm1.bias",
    "intermediate.dense.weight": "linear1.weight",
    "intermediate.dense.bias": "linear1.bias",
    "output.dense.weight": "linear2.weight",
    "output.dense.bias": "linear2.bias",
    "output.LayerNorm.weight": "norm2.weight",
    "output.LayerNorm.bias": "norm2.bias",
}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
_LAYER = re.compile(r"^(?P<prefix>.*?)(?:layer\.(?P<index>\d+)\.)?attention\.self\.query\.weight$")

BERT_DEFAULTS = {"activation": "gelu", "layer_norm_eps": 1e-12, "norm_first": False}


def bert_shape(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """What a BERT checkpoint's weights say of the block: its layer count, width and feed-forward width (the
    head count is not in the weights: a Hugging Face config.json has it as num_attention_heads)."""
    layers = _layer_prefixes(state)
    prefix = layers[0]
    try:
        ff, width = state[f"{prefix}intermediate.dense.weight"].shape
    except KeyError:
        raise CheckpointError(f"BERT layer 0 lacks '{prefix}intermediate.dense.weight'") from None
    return {"num_layers": len(layers), "d_model": int(width), "dim_feedforward": int(ff)}


def _layer_prefixes(state: dict[str, torch.Tensor]) -> dict[int, str]:
    prefixes: dict[int, str] = {}
    for key in state:
        m = _LAYER.match(key)
        if m:
            index = int(m["index"]) if m["index"] is not None else 0
            prefixes[index] = key[: -len("attention.self.query.weight")]
    if not prefixes:
        raise CheckpointError("no BertLayer weights found (no key ending in 'attention.self.query.weight')")
    if sorted(prefixes) != list(range(len(prefixes))):
        raise CheckpointError(f"BERT layers are not numbered 0..n-1: found {sorted(prefixes)}")
    return prefixes


def bert_to_encoder_state(
    state: dict[str, torch.Tensor], num_layers: int | None = None
) -> dict[str, torch.Tensor]:
    """Map one ``BertLayer`` state_dict, or a ``BertModel``/``BertEncoder`` one (``…encoder.layer.{i}.``), onto
    ``Encoder`` keys (``layers.{i}.…``). Embeddings, pooler and heads in a full model's file are ignored.
    """
    prefixes = _layer_prefixes(state)
    if num_layers is not None and num_layers != len(prefixes):
        raise CheckpointError(
            f"the BERT checkpoint has {len(prefixes)} layer(s) but --num-layers is {num_layers}: leave "
            "--num-layers out to use them all"
        )
    out: dict[str, torch.Tensor] = {}
    for i, prefix in sorted(prefixes.items()):
        try:
            out[f"layers.{i}.self_attn.in_proj_weight"] = torch.cat(
                [state[f"{prefix}{p}.weight"] for p in _QKV]
            )
            out[f"layers.{i}.self_attn.in_proj_bias"] = torch.cat([state[f"{prefix}{p}.bias"] for p in _QKV])
            for src, dst in _DIRECT.items():
                out[f"layers.{i}.{dst}"] = state[f"{prefix}{src}"]
        except KeyError as exc:
            raise CheckpointError(f"BERT layer {i} lacks {exc.args[0]!r}") from None
    return out
