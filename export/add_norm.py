"""Public API: one Add & Norm step exported on its own, for norms over the last k dims.

The seeds normalize ``[S, B, E]`` over ``(B, E)`` (``parameter_shape = (1, 3)`` in their notation); ONNX
``LayerNormalization`` does the same with ``axis=-k``. Those dims' sizes are fixed in the graph, so this is not a
servable encoder artifact, only the step itself::

    from addnorm.export.add_norm import export_add_norm
    from addnorm.model.encoder import AddNorm
    export_add_norm(AddNorm((2, 3)).eval(), torch.randn(4, 2, 3), "add_norm.onnx")
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from addnorm.export.onnx_export import DEFAULT_OPSET, export_module, load_checked


class AddNormModule(nn.Module):
    """``x -> add_norm(x, linear)``: an Add & Norm step around a seeded linear sublayer."""

    def __init__(self, add_norm: nn.Module, features: int) -> None:
        super().__init__()
        self.add_norm = add_norm
        self.sublayer = nn.Linear(features, features)

    def forward(self, x: Tensor) -> Tensor:
        return self.add_norm(x, self.sublayer)


def export_add_norm(
    add_norm: nn.Module, example: Tensor, path: str | Path, opset: int = DEFAULT_OPSET
) -> onnx.ModelProto:
    """Export one Add & Norm step around a linear sublayer (seed 0), with fixed shapes: x -> y."""
    torch.manual_seed(0)
    module = AddNormModule(add_norm, example.shape[-1]).eval()
    export_module(module, (example,), Path(path), (["x"], ["y"]), None, opset)
    return load_checked(path, opset)
