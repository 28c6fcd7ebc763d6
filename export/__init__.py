"""The only bridge torch -> ONNX: export, graph checks, parity gate, variants. Needs the 'export' extra."""

from addnorm.model.extras import require

require("export", "addnorm-export / addnorm-parity", "torch", "onnx", "onnxscript", "safetensors")
