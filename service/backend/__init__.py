"""The backend: ``engine`` (an onnxruntime session behind a small interface: run, verify, release) and ``cores``
(the CPU thread budget every model's runs share). Imports nothing of the serving layers above it."""
