"""The only bridge torch -> ONNX: export, graph checks, parity against torch and a float64 oracle."""
