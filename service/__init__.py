"""onnxruntime + FastAPI serving of an addnorm artifact. Never imports torch, nor export/.

``create_app`` and ``Settings`` are imported on first use, so importing one light module of the package
(``service.backend.cores`` for the benchmarks' thread count, say) does not load onnxruntime and FastAPI.
"""

import os

# The libraries' own thread pools, the one place the server sets them (each read once, when its library loads: here,
# the first import of the package, is before either loads). An operator's value still decides.
# numpy's OpenBLAS threads (only live parity's checker multiplies matrices in numpy here) would spin on the cores
# onnxruntime runs on: one thread (docs/benchmarks.md, "Live parity's cost").
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Hugging Face tokenizers splits a request's inputs over a thread per core: here requests already run side by side
# and the cores are the model's; its threads took more CPU than tokenizing in the caller's thread
# (docs/benchmarks.md, "What the measurements decided": tokenizing on the request's thread).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["Settings", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from addnorm.service.front.app import create_app

        return create_app
    if name == "Settings":
        from addnorm.service.settings import Settings

        return Settings
    raise AttributeError(f"module 'service' has no attribute {name!r}")
