"""python -m bench: ratios measured side by side in one run. Needs the 'export' extra (torch, for torch eager)."""

from addnorm.model.extras import require

require("export", "python -m bench", "torch", "onnx", "safetensors")
