"""The backend: what a served model offers the layers above (``interface.Backend``), its onnxruntime implementation
(``engine``, with ``text``: an artifact's tokenizer and embedding layer) and ``cores`` (the CPU thread budget every
model's runs share, and the gate on a request's heavy steps). Imports nothing of the serving layers above it."""
