"""addnorm: a Transformer encoder block's Add & Norm steps exported to ONNX LayerNormalization, proven equal to
PyTorch by a parity gate, and served by onnxruntime (text or embeddings in, vectors out).

One installed name: ``addnorm.model`` (the block, its contract and artifacts; no torch), ``addnorm.export`` (export
and parity; the ``export`` extra) and ``addnorm.service`` (the server). In a checkout they are the repository's
top-level folders ``model/``, ``export/`` and ``service/``; an install puts them under ``addnorm/``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

_here = Path(__file__).resolve().parent
if not (_here / "model").is_dir():  # a checkout: the subpackages are the repository's top-level folders
    __path__.append(str(_here.parent))  # type: ignore[name-defined]

try:
    __version__ = metadata.version("addnorm")
except metadata.PackageNotFoundError:  # a checkout nobody installed
    __version__ = "0+unknown"
