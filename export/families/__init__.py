"""Encoder families: how each maps its checkpoint onto the encoder block and the embedding layer, chosen by
``config.json``'s ``model_type``.

A family is one module here with a ``FAMILY`` (``Family``): which ``model_type``s it reads, its per-layer key names,
its embedding layer's, and what its config.json says of the block (``fields``: EncoderConfig's options, such as a
gated feed-forward or MPNet's relative position bias, which the shared block, the numpy oracle and the export
compute) and of the embedding layer and the tokenizer (``text``). Every module here with a ``FAMILY`` is one:
adding a family is that module and its test (tests/export/test_families.py builds a tiny random model of each with
transformers' own classes); a block option no family has had yet is a field of model/config.py's EncoderConfig,
computed by model/encoder.py and model/reference.py (tests/export/test_family_shape.py shows the shape).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from addnorm.export.weights import CheckpointError
from addnorm.model.config import ConfigError

# config.json's hidden_act / activation -> the encoder's activation (transformers' "gelu" is the exact, erf GELU)
ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}
EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")


@dataclass(frozen=True)
class Family:
    """One encoder family's differences.

    ``layer_keys``: encoder block key (``torch.nn.TransformerEncoderLayer``'s names) -> the checkpoint's key within
    one layer; ``qkv``: its three attention projections (stacked into ``in_proj``); ``embeddings``: the embedding
    layer's parts (``EMBEDDING_PARTS``) -> the checkpoint's names under ``…embeddings.``; ``fields(config)``: the
    block's EncoderConfig fields; ``text(config)``: the embedding layer's TextConfig fields but ``max_length`` and
    ``prompts`` (the model directory's, export/model_dir.py); ``stack_keys``: the stack's own weights, outside any layer
    (``Encoder`` key -> the checkpoint key's ending: MPNet's relative position bias); ``head_keys``: its
    ``*ForSequenceClassification`` head's weights, the same way (``head.dense``, ``head.out``), and
    ``head_activation`` between them; ``sparse_keys``: its ``*ForMaskedLM`` head's (``head.dense``, ``head.norm``,
    ``head.decoder``; the decoder's weight is the word embeddings' where the checkpoint ties them, as transformers
    saves it), and ``sparse_activation`` inside it (None: the block's, config.json's ``hidden_act``)."""

    name: str
    model_types: tuple[str, ...]
    layer_keys: dict[str, str]
    qkv: tuple[str, str, str]
    embeddings: dict[str, str]
    fields: Callable[[dict], dict]
    text: Callable[[dict], dict]
    stack_keys: dict[str, str] = field(default_factory=dict)
    head_keys: dict[str, str] = field(default_factory=dict)
    head_activation: str = "tanh"
    sparse_keys: dict[str, str] = field(default_factory=dict)
    sparse_activation: str | None = None
    bias: bool = True  # false: the checkpoint's products and norms have no biases (ModernBERT)
    first_layer_lacks: tuple[
        str, ...
    ] = ()  # ``layer_keys`` the first layer has none of (ModernBERT's attn_norm)

    def block_fields(self, config: dict, task: str | None = None) -> dict:
        """What config.json says of the block: ``fields``, and the head ``task`` asks for (TASKS; None: a
        classification head where ``architectures`` name one, ``*ForSequenceClassification``, with as many labels
        as its ``id2label``, else ``num_labels``; none otherwise)."""
        fields = self.fields(config)
        architectures = [str(a) for a in config.get("architectures") or []]
        classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
        if task in ("rerank", "classify") and not classifier:
            raise ConfigError(
                f"--task {task} needs a *ForSequenceClassification checkpoint (a cross-encoder or a classifier); "
                f"config.json's architectures are {architectures}"
            )
        if classifier and task in (None, "rerank", "classify"):
            labels = config.get("id2label") or {}
            count = len(labels) if isinstance(labels, dict) and labels else config.get("num_labels", 2)
            if task is not None and (count == 1) != (task == "rerank"):
                raise ConfigError(
                    f"--task {task}: config.json's head has {count} label(s); a cross-encoder (--task rerank) has "
                    "one, a classifier (--task classify) several"
                )
            fields.update(head="classify", num_labels=count, head_activation=self.head_activation)
        head = "classify" if "num_labels" in fields and task != "sparse" else task
        if (
            head in ("classify", "sparse")
            and not {"classify": self.head_keys, "sparse": self.sparse_keys}[head]
        ):
            raise ConfigError(
                f"{self.name}'s {'classification' if head == 'classify' else 'masked-LM'} head is not mapped onto "
                "the block: --task embed exports its encoder alone"
            )
        if task == "sparse":
            activation_name = self.sparse_activation or fields.get("activation", "gelu")
            fields.update(
                head="sparse", vocab_size=int(config["vocab_size"]), head_activation=activation_name
            )
        return fields

    @staticmethod
    def labels(config: dict) -> tuple[str, ...]:
        """A classification head's label names by index (config.json's ``id2label``); () without them."""
        labels = config.get("id2label") or {}
        try:
            return tuple(str(labels[k]) for k in sorted(labels, key=int))
        except (TypeError, ValueError, AttributeError):
            raise ConfigError(
                f"config.json's id2label must map label indices to names, got {labels!r}"
            ) from None

    def _layers(self, state: dict[str, torch.Tensor]) -> dict[int, str]:
        query = f"{self.qkv[0]}.weight"
        pattern = re.compile(rf"^(?P<prefix>.*?)(?:layers?\.(?P<index>\d+)\.)?{re.escape(query)}$")
        prefixes: dict[int, str] = {}
        for key in state:
            if m := pattern.match(key):
                index = int(m["index"]) if m["index"] is not None else 0
                prefixes[index] = key[: -len(query)]
        if not prefixes:
            raise CheckpointError(f"no {self.name} layer weights found (no key ending in {query!r})")
        if sorted(prefixes) != list(range(len(prefixes))):
            raise CheckpointError(f"{self.name} layers are not numbered 0..n-1: found {sorted(prefixes)}")
        return prefixes

    def shape(self, state: dict[str, torch.Tensor], config: dict | None = None) -> dict[str, int]:
        """What the weights say of the block: its layer count, width and feed-forward width (half the input
        projection's rows for a gated feed-forward, which ``fields`` of ``config``, config.json, says it has)."""
        layers = self._layers(state)
        key = f"{layers[0]}{self.layer_keys['linear1.weight']}"
        if key not in state:
            raise CheckpointError(f"{self.name} layer 0 lacks {key!r}")
        rows, width = state[key].shape
        gated = self.fields(config or {}).get("feed_forward") == "gated"
        if gated and rows % 2:
            raise CheckpointError(
                f"{self.name}'s gated feed-forward projects to {rows} rows: not input and gate"
            )
        return {
            "num_layers": len(layers),
            "d_model": int(width),
            "dim_feedforward": int(rows // 2 if gated else rows),
        }

    def block_state(
        self, state: dict[str, torch.Tensor], num_layers: int | None = None, head: str = "none"
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's layers as ``Encoder`` keys (``layers.{i}.…``), and its ``head``'s (EncoderConfig.head:
        ``classify``, ``sparse``); everything else in it is ignored."""
        prefixes = self._layers(state)
        if num_layers is not None and num_layers != len(prefixes):
            raise CheckpointError(
                f"the {self.name} checkpoint has {len(prefixes)} layer(s) but --num-layers is {num_layers}: leave "
                "--num-layers out to use them all"
            )
        out: dict[str, torch.Tensor] = {}
        for i, prefix in sorted(prefixes.items()):
            try:
                out[f"layers.{i}.self_attn.in_proj_weight"] = torch.cat(
                    [state[f"{prefix}{p}.weight"] for p in self.qkv]
                )
                if self.bias:
                    out[f"layers.{i}.self_attn.in_proj_bias"] = torch.cat(
                        [state[f"{prefix}{p}.bias"] for p in self.qkv]
                    )
                for dst, src in self.layer_keys.items():
                    if i == 0 and dst in self.first_layer_lacks:
                        continue
                    out[f"layers.{i}.{dst}"] = state[f"{prefix}{src}"]
            except KeyError as exc:
                raise CheckpointError(f"{self.name} layer {i} lacks {exc.args[0]!r}") from None
        head_keys = {"classify": self.head_keys, "sparse": self.sparse_keys}.get(head, {})
        for dst, ending in {**self.stack_keys, **head_keys}.items():
            found = [k for k in state if k == ending or k.endswith(f".{ending}")]
            if not found and dst == "head.decoder.weight":  # tied to the word embeddings, saved once
                found = [
                    k for k in state if k.endswith(f"embeddings.{self.embeddings['word_embeddings']}.weight")
                ]
            if len(found) != 1:
                raise CheckpointError(
                    f"the {self.name} checkpoint has {len(found)} keys ending in {ending!r}, not one: {found[:3]}"
                    + (
                        f": the {head} head's weights (--task embed exports the encoder alone)"
                        if dst in head_keys
                        else ""
                    )
                )
            out[dst] = state[found[0]]
        return out

    def embedding_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The embedding layer's weights as ``model.embedding.EmbeddingAddNorm`` keys."""
        word = f"embeddings.{self.embeddings['word_embeddings']}.weight"
        prefix = next((k[: -len(word)] for k in state if k.endswith(word)), None)
        if prefix is None:
            raise CheckpointError(
                f"the checkpoint has no embedding layer (no key ending in {word!r}): export it with "
                "--inputs embeddings, or give the whole model's weights"
            )
        out = {}
        for part, name in self.embeddings.items():
            for what in ("weight", "bias") if part == "LayerNorm" else ("weight",):
                key = f"{prefix}embeddings.{name}.{what}"
                if key not in state:
                    if what == "bias" and not self.bias:  # a bias-free family's norm
                        continue
                    raise CheckpointError(f"the {self.name} embedding layer lacks {key!r}")
                out[f"{part}.{what}"] = state[key]
        return out


def families() -> list[Family]:
    """Every module of this package with a ``FAMILY``, by module name."""
    found = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__))
    return [module.FAMILY for module in sorted(found, key=lambda m: m.__name__) if hasattr(module, "FAMILY")]


def supported() -> list[str]:
    return sorted(t for f in families() for t in f.model_types)


def family_of(config: dict | None, source: str = "config.json") -> Family:
    """The family ``config.json``'s ``model_type`` names (BERT without a config.json: a bare weights file)."""
    config = config or {}
    model_type = config.get("model_type", "bert")
    for family in families():
        if model_type in family.model_types:
            if config.get("is_decoder") or config.get("add_cross_attention"):
                raise ConfigError(
                    f"{source} describes a decoder (is_decoder / add_cross_attention): not an encoder block"
                )
            return family
    raise ConfigError(f"{source} has model_type {model_type!r}; supported: {', '.join(supported())}")


def activation(value: str, key: str = "hidden_act", source: str = "config.json") -> str:
    if value not in ACTIVATIONS:
        raise ConfigError(
            f"{source} has {key} {value!r}; the encoder block computes {sorted(ACTIVATIONS)} (exact erf GELU)"
        )
    return ACTIVATIONS[value]


def present(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if v is not None}
