"""addnorm: a Transformer encoder block's Add & Norm steps exported to ONNX LayerNormalization, proven equal to
PyTorch by a parity gate, and served by onnxruntime (text or embeddings in, vectors out).

One installed name: ``addnorm.model`` (the block, its contract and artifacts; no torch), ``addnorm.export`` (export
and parity; the ``export`` extra) and ``addnorm.service`` (the server). In a checkout they are the repository's
top-level folders ``model/``, ``export/`` and ``service/``; an install puts them under ``addnorm/``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

FOLDERS = ("model", "export", "service")  # what installs under addnorm (setup.py), and nothing else


class _Checkout(importlib.abc.MetaPathFinder):
    """In a checkout, ``addnorm.model``, ``.export`` and ``.service`` are the repository's top-level folders (and
    only those: ``addnorm.bench`` or ``addnorm.tests`` is no module, as in an install)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in FOLDERS:
            return None
        init = self.root / name / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)]
        )


_here = Path(__file__).resolve().parent
if not (_here / "model").is_dir():  # a checkout (installed editable, or on PYTHONPATH): this one's folders
    sys.meta_path.insert(0, _Checkout(_here.parent))

try:
    __version__ = metadata.version("addnorm")
except metadata.PackageNotFoundError:  # a checkout nobody installed
    __version__ = "0+unknown"
