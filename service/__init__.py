"""onnxruntime + FastAPI serving of an addnorm artifact. Never imports torch, nor export/."""

import os

# numpy's OpenBLAS threads (only live parity's checker multiplies matrices in numpy here) would spin on the cores
# onnxruntime runs on: one thread, set before numpy loads (measured: docs/benchmarks.md, "Live parity's cost").
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from service.app import create_app
from service.settings import Settings

__all__ = ["Settings", "create_app"]
