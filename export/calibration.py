"""``--calibration FILE``: representative inputs for the parity gate, as a user has them.

A file of embeddings ``[N, S, E]`` (what the served model receives: a BERT embedding layer's output):
``.npy``; ``.npz`` or ``.safetensors`` with ``embeddings`` and optionally ``mask`` ``[N, S]`` (true = padding) or
``lengths`` ``[N]``; or ``.txt``, one sentence a line, embedded with the model directory's own tokenizer and
embedding layer (export.hf.Reference; needs transformers). They become the gate's representative cases: a lossy
variant's quality is judged on them, and a few of them are kept as the artifact's golden data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from addnorm.export.cases import Given
from addnorm.model.config import ConfigError
from addnorm.model.contract import EMBEDDINGS, MASK

CASE_ROWS = 8  # sequences per case: the gate runs each case as one batch


def load_arrays(path: str | Path, reference=None) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings (N, S, E) float32, mask (N, S) bool) from ``path``; ``reference`` (export.hf.Reference)
    embeds a .txt file's sentences."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--calibration {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _sentences(path, reference)
    if suffix not in (".npy", ".npz", ".safetensors"):
        raise ConfigError(f"--calibration {path}: expected .npy, .npz, .safetensors or .txt")
    try:
        arrays = _read(path, suffix)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--calibration {path} cannot be read: {exc}") from None
    if EMBEDDINGS not in arrays:  # the file's arrays are named as the graph's inputs
        raise ConfigError(f"--calibration {path} has no '{EMBEDDINGS}' array (it has {sorted(arrays)})")
    return _checked(path, np.asarray(arrays[EMBEDDINGS]), arrays.get(MASK), arrays.get("lengths"))


def _read(path: Path, suffix: str) -> dict[str, np.ndarray]:
    if suffix == ".npy":
        return {EMBEDDINGS: np.load(path, allow_pickle=False)}
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    from safetensors.numpy import load_file

    return load_file(str(path))


def _sentences(path: Path, reference) -> tuple[np.ndarray, np.ndarray]:
    if reference is None:
        raise ConfigError(
            f"--calibration {path}: sentences need the model's tokenizer and embedding layer; give "
            "--from a model directory (config.json, tokenizer) with transformers installed, or "
            "embeddings as .npy/.npz/.safetensors"
        )
    return reference.embed(sentences_of(path))


def sentences_of(path: str | Path) -> list[str] | None:
    """A .txt ``--calibration`` file's sentences, one a line (None for a file of embeddings)."""
    path = Path(path)
    if path.suffix.lower() != ".txt":
        return None
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calibration {path} cannot be read: {exc}") from None
    if not lines:
        raise ConfigError(f"--calibration {path} holds no sentence")
    return lines


def _checked(path: Path, x: np.ndarray, mask, lengths) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim != 3 or 0 in x.shape or not np.issubdtype(x.dtype, np.floating):
        raise ConfigError(
            f"--calibration {path}: embeddings must be float [N, S, E], got {x.dtype} {list(x.shape)}"
        )
    if not np.isfinite(x).all():
        raise ConfigError(f"--calibration {path}: embeddings hold NaN or infinity")
    n, s, _ = x.shape
    if mask is not None and lengths is not None:
        raise ConfigError(f"--calibration {path}: give 'mask' or 'lengths', not both")
    if lengths is not None:
        lengths = np.asarray(lengths)
        if lengths.shape != (n,) or (lengths < 1).any() or (lengths > s).any():
            raise ConfigError(f"--calibration {path}: 'lengths' must be [N] = [{n}] values in 1..{s}")
        mask = np.arange(s)[None, :] >= lengths[:, None]
    mask = np.zeros((n, s), bool) if mask is None else np.asarray(mask)
    if mask.shape != (n, s) or mask.dtype != bool:
        raise ConfigError(f"--calibration {path}: 'mask' must be bool [N, S] = [{n}, {s}], true at padding")
    if mask.all(axis=1).any():
        raise ConfigError(f"--calibration {path}: a sequence is all padding")
    return x.astype(np.float32), mask


def calibration_cases(x: np.ndarray, mask: np.ndarray, d_model: int) -> list[Given]:
    """The inputs as gate cases of up to CASE_ROWS sequences of like length, each cut to its longest one."""
    if x.shape[-1] != d_model:
        raise ConfigError(
            f"--calibration embeddings are {x.shape[-1]} wide; the model's d_model is {d_model}"
        )
    lengths = (~mask).sum(1)
    order = np.argsort(lengths, kind="stable")
    cases = []
    for start in range(0, len(order), CASE_ROWS):
        rows = order[start : start + CASE_ROWS]
        seq = int(lengths[rows].max())
        cases.append(
            Given(
                f"given {start // CASE_ROWS + 1} ({len(rows)} x {seq})",
                len(rows),
                seq,
                embeddings=np.ascontiguousarray(x[rows, :seq]),
                mask=np.ascontiguousarray(mask[rows, :seq]),
            )
        )
    return cases
