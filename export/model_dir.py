"""Hugging Face model directories as users have them: ``config.json`` + ``model.safetensors`` (or
``pytorch_model.bin``), a tokenizer, and a sentence-transformers pipeline's files.

``read_model_dir`` reads the weights and what ``config.json`` says of the encoder layers (its family's reading:
export/families); ``sentence_pooling`` and ``text_limits`` read what the sentence-transformers files say of the
pooling, the longest input and the prompts. No transformers here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from addnorm.export.families import Family, family_of
from addnorm.export.weights import CheckpointError, read_state_dict

log = logging.getLogger("addnorm.export")

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


@dataclass(frozen=True)
class ModelDir:
    """A checkpoint: its weights file, and its directory when that holds a config.json."""

    weights: Path
    directory: Path | None  # holds config.json (and usually the tokenizer)

    @property
    def family(self) -> Family:
        """Its encoder family, by config.json's model_type (BERT for a bare weights file)."""
        config = self.config
        return family_of(config, str(self.directory / CONFIG_FILE) if config is not None else CONFIG_FILE)

    @property
    def config(self) -> dict | None:
        if self.directory is None:
            return None
        try:
            return json.loads((self.directory / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {self.directory / CONFIG_FILE}: {exc}") from None


def locate(path: str | Path) -> ModelDir:
    """``path``: a model directory (config.json + model.safetensors or pytorch_model.bin), or a weights file
    (whose directory's config.json, if any, is read too)."""
    path = Path(path)
    if path.is_dir():
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise CheckpointError(f"model directory {path} holds none of {', '.join(WEIGHT_FILES)}")
        if not (path / CONFIG_FILE).is_file():
            raise CheckpointError(f"model directory {path} has no {CONFIG_FILE}")
        return ModelDir(weights, path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (give a model directory or a weights file)")
    return ModelDir(path, path.parent if (path.parent / CONFIG_FILE).is_file() else None)


# What an exported model answers (EncoderConfig.task), as --task names it: ``tokens`` is an embedder without pooling
TASKS = ("embed", "rerank", "classify", "sparse", "tokens")


def config_fields(config: dict, source: str = CONFIG_FILE, task: str | None = None) -> dict:
    """What a Hugging Face config.json says of the encoder layers and the head ``task`` asks for (None: the one
    its ``architectures`` name), as EncoderConfig fields (its family's reading: export/families)."""
    return family_of(config, source).block_fields(config, task)


def read_model_dir(
    path: str | Path, task: str | None = None
) -> tuple[dict[str, torch.Tensor], dict, ModelDir]:
    """(state_dict, config.json's EncoderConfig fields ({} without one), where it came from); ``task``: the head
    to read (TASKS), else the directory's own (``directory_task``, then config.json's ``architectures``)."""
    where = locate(path)
    config = where.config
    task = task or directory_task(where.directory)
    if config is None and task not in (None, "embed", "tokens"):
        raise CheckpointError(
            f"--task {task} needs a model directory with its config.json, not a bare weights file"
        )
    fields = config_fields(config, str(where.directory / CONFIG_FILE), task) if config is not None else {}
    return read_state_dict(where.weights), fields, where


def _modules(directory: Path | None) -> list[dict]:
    """A sentence-transformers directory's pipeline (modules.json), [] without one or unreadable."""
    if directory is None or not (directory / "modules.json").is_file():
        return []
    try:
        modules = json.loads((directory / "modules.json").read_text())
        return [m for m in modules if isinstance(m, dict) and isinstance(m.get("type"), str)]
    except (OSError, ValueError, TypeError):
        return []


def _splade(directory: Path | None) -> dict | None:
    """A SparseEncoder's SpladePooling module's config (its pooling and activation), None without one."""
    module = next((m for m in _modules(directory) if m["type"].endswith("SpladePooling")), None)
    if module is None:
        return None
    try:
        return json.loads((directory / module.get("path", "") / CONFIG_FILE).read_text()) or {}
    except (OSError, ValueError):
        return {}


def directory_task(directory: Path | None) -> str | None:
    """The task a sentence-transformers directory's pipeline says: ``sparse`` for a SparseEncoder (SpladePooling);
    None otherwise (config.json's ``architectures`` decide: many embedders name ``*ForMaskedLM`` there, with no
    masked-LM head in their weights)."""
    return "sparse" if _splade(directory) is not None else None


# sentence-transformers' Pooling modes this graph computes (1_Pooling/config.json's keys), as --pooling values
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def sentence_pooling(directory: Path | None) -> dict:
    """What a sentence-transformers model directory's pipeline (modules.json: Pooling, then Normalize; or a
    SparseEncoder's SpladePooling) makes of the encoder's output, as EncoderConfig fields (``pooling``,
    ``normalize_pooled``; ``sparse_pooling``, ``sparse_activation``); {} for a plain BERT directory
    or a pooling this graph does not compute (max, weighted mean: logged, and no pooled output)."""
    splade = _splade(directory)
    if splade is not None:  # SpladePooling: the sparse head's pooling; no dense pooled output
        return {
            "pooling": "none",
            "normalize_pooled": False,
            "sparse_pooling": splade.get("pooling_strategy", "max"),
            "sparse_activation": splade.get("activation_function", "relu"),
        }
    if directory is None or not (directory / "modules.json").is_file():
        return {}
    try:
        modules = json.loads((directory / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        pooling = next(m for m in modules if m["type"].endswith(".Pooling"))
        config = json.loads((directory / pooling.get("path", "") / CONFIG_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return {}
    modes = [mode for key, mode in _ST_POOLING.items() if config.get(key)]
    others = sorted(
        k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_POOLING
    )
    if len(modes) != 1 or others:
        what = ", ".join(others) or "several modes at once"
        log.warning(
            "%s pools with %s: the graph computes mean or cls pooling only: no pooled output", directory, what
        )
        return {}
    return {"pooling": modes[0], "normalize_pooled": "Normalize" in kinds[kinds.index("Pooling") + 1 :]}


def contradictions(from_config: dict, given: dict, flags: bool = True) -> list[str]:
    """Values that say otherwise than config.json, as '--flag X (config.json: Y)' (``flags``) or 'field X (...)'."""
    return [
        f"{'--' + name.replace('_', '-') if flags else name} {given[name]} (config.json: {value})"
        for name, value in from_config.items()
        if given.get(name) is not None and given[name] != value
    ]


def text_limits(directory: Path, text_fields: dict) -> dict:
    """What a model directory says of its inputs: ``max_length`` (sentence-transformers' ``max_seq_length``
    where it has one, within the positions the embedding layer has), ``prompts`` and ``default_prompt_name``, and
    ``clean_up_spaces`` where ``tokenizer_config.json`` asks transformers' decode for it."""
    offset = text_fields["pad_token_id"] + 1 if text_fields["positions"] == "after_padding" else 0
    positions = text_fields["max_positions"] - offset
    limits: dict = {"max_length": positions, "prompts": {}}
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        try:
            value = json.loads((directory / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and value > 0:
            limits["max_length"] = min(value, positions)
            break
    try:
        if (
            json.loads((directory / "tokenizer_config.json").read_text()).get("clean_up_tokenization_spaces")
            is True
        ):
            limits["clean_up_spaces"] = True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        pipeline = json.loads((directory / "config_sentence_transformers.json").read_text())
        limits["prompts"] = {str(k): str(v) for k, v in (pipeline.get("prompts") or {}).items()}
        default = pipeline.get("default_prompt_name")
        if default in limits["prompts"]:  # sentence-transformers puts it before every text that names none
            limits["default_prompt_name"] = default
    except (OSError, ValueError, AttributeError):
        pass
    return limits
