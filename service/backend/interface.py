"""What a served model offers the layers above the backend (the batcher, the request core, the protocols, the
registry): ``Backend``. ``engine.Engine`` (onnxruntime, on the execution providers of model/runtime.py's table)
implements it; the one place a backend is built is ``models.state.serving_model``, and nothing above imports an
implementation (tests/test_layout.py). A new backend (TensorRT, another runtime) is a module here that has these
members, and that one line in state.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from addnorm.model.artifact import Manifest
    from addnorm.model.golden import Verification
    from addnorm.service.backend.text import TextFront


class Backend(Protocol):
    """One loaded artifact, ready to run."""

    manifest: Manifest  # the artifact's: its config (width, heads, layout), inputs, outputs, variant, parity
    directory: Path  # where it was loaded from
    providers: list[str]  # the execution providers its session runs on, the first doing the work
    threads: int  # the CPU threads a run at light load keeps busy (what it holds of the server's budget: backend/cores.py)
    # runs it takes at once under load, each keeping threads // lanes threads busy (1: one run at a time on all)
    lanes: int
    packed: bool  # its graph computes each row to its own length: ``run`` takes ``lengths``
    d_model: int  # the width of its input embeddings and outputs
    heads: int  # attention heads (the batcher's attention budget)
    held_attention: str  # the seq x seq tensors a run holds (model/attention.py's forms)
    text: (
        TextFront | None
    )  # tokenizer and embedding layer, for an artifact that takes text; None: embeddings only

    @property
    def name(self) -> str:
        """The model's name (its manifest's)."""
        ...

    @property
    def on_cpu(self) -> bool:
        """Whether its runs are the CPU's work (they hold threads of the budget; a GPU's do not)."""
        ...

    def run(
        self,
        embeddings: np.ndarray,
        mask: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
        light: bool = False,
    ) -> dict[str, np.ndarray]:
        """(B, S, E) batch-first embeddings, ``mask`` (B, S) true at padding, ``lengths`` (B,) for a packed graph ->
        every output by name, batch-first float32. ``light``: the run has all ``threads`` and the model to itself:
        few requests wait on the model (the batcher's LIGHT_LOAD and HEAVY_LOAD), so the HTTP front has little to do
        beside it and a CPU engine may spend spinning threads on its latency (``--intra-op-spinning light``), or the
        run is too big to run beside another (the batcher's ALONE_ABOVE_BYTES); otherwise it is one of up to
        ``lanes`` runs at once. Called from up to ``lanes`` threads at once."""
        ...

    def working_bytes(self, rows: int, seq: int, padded: bool) -> int:
        """About the activation memory a run of ``rows`` x ``seq`` holds at its peak (the batcher runs a big one
        alone)."""
        ...

    def release(self) -> bool:
        """Give back memory its last runs held (called when idle); True when it gave some."""
        ...

    def verify(self, mode: str) -> Verification:
        """Its golden check on this provider (``--verify-on-load``: strict, warn or off)."""
        ...

    def describe(self) -> dict:
        """Its manifest and what runs it (GET /v1/model)."""
        ...
