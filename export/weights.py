"""Read and write encoder weights: safetensors (preferred) or a torch state_dict read with weights_only=True."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from addnorm.model.encoder import Encoder


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or its keys or shapes do not fit the encoder config."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a flat name -> tensor mapping from ``.safetensors`` or a torch file, never unpickling code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ... for bad or unsafe files
        # One line of ours: torch's own message is several and suggests weights_only=False (running the file's code)
        if "Weights only load failed" in str(exc):
            why = (
                "it holds Python objects besides tensors (a whole pickled model or an optimizer?), and loading "
                "those would run code from the file; save model.state_dict() instead (torch.save or safetensors)"
            )
        else:
            why = "it is neither a safetensors file nor a torch.save archive of tensors"
        raise CheckpointError(f"cannot read checkpoint {path}: {why}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state_dict (a mapping of names to tensors)")
    return state


def adapt_keys(state: dict[str, torch.Tensor], encoder: Encoder) -> dict[str, torch.Tensor]:
    """Accept the keys of one ``nn.TransformerEncoderLayer`` for a one-layer encoder (adds ``layers.0.``)."""
    if encoder.config.num_layers == 1 and state and not any(k.startswith("layers.") for k in state):
        return {f"layers.0.{k}": v for k, v in state.items()}
    return state


def load_weights(encoder: Encoder, path: str | Path) -> Encoder:
    """Load a checkpoint file into ``encoder`` strictly: every key must match in name and shape."""
    return load_state(encoder, read_state_dict(path), path)


def load_state(encoder: Encoder, state: dict[str, torch.Tensor], source: str | Path) -> Encoder:
    """Load a state_dict (read from ``source``) into ``encoder`` strictly, naming every key that does not fit."""
    state = adapt_keys(state, encoder)
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if shapes:
        problems.append("shape mismatches " + _short(shapes))
    if problems:
        raise CheckpointError(
            f"checkpoint {source} does not fit the encoder config ({encoder.config.to_dict()}): "
            + "; ".join(problems)
            + ". Pass the config the weights were trained with (--config or --d-model/--nhead/...)."
        )
    encoder.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return encoder.eval()


def save_weights(encoder: Encoder, path: str | Path) -> None:
    save_file({k: v.detach().contiguous() for k, v in encoder.state_dict().items()}, str(path))


def _short(items: list[str], n: int = 8) -> str:
    return str(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
