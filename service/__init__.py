"""onnxruntime + FastAPI serving of an addnorm artifact. Never imports torch, nor export/.

``create_app`` and ``Settings`` are imported on first use, so importing one light module of the package
(``service.backend.cores`` for the benchmarks' thread count, say) does not load onnxruntime and FastAPI.
"""

import os

# numpy's OpenBLAS threads (only live parity's checker multiplies matrices in numpy here) would spin on the cores
# onnxruntime runs on: one thread, set before numpy loads (measured: docs/benchmarks.md, "Live parity's cost").
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__all__ = ["Settings", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from addnorm.service.front.app import create_app

        return create_app
    if name == "Settings":
        from addnorm.service.settings import Settings

        return Settings
    raise AttributeError(f"module 'service' has no attribute {name!r}")
