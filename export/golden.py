"""Golden data for the artifact: a few fixed inputs with their float64-oracle and torch fp32 outputs (model.golden)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from export.cases import Case
from export.parity import torch_outputs
from model.contract import EMBEDDINGS, MASK, OUTPUT_NAMES
from model.encoder import Encoder
from model.golden import save_golden

# Short and long, with and without padding; sizes unlike the export example (2, 5) and the parity cases' seeds.
GOLDEN_CASES = (
    Case("short", 1, 7),
    Case("padded", 3, 24, pad=0.5),
    Case("long", 1, 256),
)
GOLDEN_SEED = 20261122


def write_golden(encoder: Encoder, path: str | Path) -> None:
    """Compute every golden case on ``encoder`` (torch fp32) and its float64 copy, and save them to ``path``."""
    encoder = encoder.eval().float()
    oracle = copy.deepcopy(encoder).double()
    cfg = encoder.config
    rng = np.random.default_rng(GOLDEN_SEED)
    cases = {}
    for case in GOLDEN_CASES:
        x, mask = case.make(cfg.d_model, rng)  # (B, S, E)
        graph_x = x if cfg.batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))
        ref = torch_outputs(encoder, graph_x, mask, with_steps=False)
        exact = torch_outputs(oracle, graph_x.astype(np.float64), mask, with_steps=False)
        arrays = {EMBEDDINGS: x, MASK: mask}
        for name in OUTPUT_NAMES:
            got, want = ref[name], exact[name]
            if not cfg.batch_first:  # stored as the service speaks: batch-first
                got, want = got.swapaxes(0, 1), want.swapaxes(0, 1)
            arrays[f"torch.{name}"], arrays[f"oracle.{name}"] = (
                got.astype(np.float32),
                want.astype(np.float64),
            )
        cases[case.name] = arrays
    save_golden(path, cases)
