"""Engine start-up: artifact verification and provider selection (tested on CPU; CUDA paths by simulation)."""

import numpy as np
import pytest

from service import engine as engine_mod
from service.engine import CPU, CUDA, Engine, EngineError, physical_cores, resolve_providers


@pytest.mark.parametrize(
    ("requested", "available", "expected"),
    [("cpu", [CUDA, CPU], [CPU]), ("auto", [CUDA, CPU], [CUDA, CPU]), ("auto", [CPU], [CPU]),
     ("cuda", [CUDA, CPU], [CUDA, CPU])],
)  # fmt: skip
def test_provider_resolution(requested, available, expected):
    assert resolve_providers(requested, available) == expected


def test_cuda_never_falls_back_silently():
    with pytest.raises(EngineError, match="onnxruntime-gpu|GPU build"):
        resolve_providers("cuda", [CPU])
    with pytest.raises(EngineError, match="unknown providers"):
        resolve_providers("tpu", [CPU])


def test_cuda_that_fails_to_initialize_is_refused(tiny_artifact, monkeypatch):
    """onnxruntime drops CUDA with only a warning when its libraries fail to load: the engine must not."""
    monkeypatch.setattr(engine_mod.ort, "get_available_providers", lambda: [CUDA, CPU])
    real_session = engine_mod.ort.InferenceSession

    def session(path, opts, providers):  # what onnxruntime does when CUDA cannot start
        return real_session(path, opts, providers=[CPU])

    monkeypatch.setattr(engine_mod.ort, "InferenceSession", session)
    with pytest.raises(EngineError, match="Refusing to fall back"):
        Engine(tiny_artifact, "cuda")
    assert Engine(tiny_artifact, "auto").providers == [CPU]  # auto: warns and serves on CPU


def test_engine_runs(tiny_artifact):
    eng = Engine(tiny_artifact, "cpu", intra_op_threads=1)
    assert eng.providers == [CPU] and eng.d_model == 32 and eng.threads == 1
    out = eng.run(np.zeros((2, 3, 32), np.float32))
    assert out.shape == (2, 3, 32) and out.dtype == np.float32
    masked = eng.run(np.ones((1, 3, 32), np.float32), np.array([[False, False, True]]))
    assert np.isfinite(masked).all()


def test_engine_refuses_a_tampered_graph(tiny_artifact, tmp_path):
    for name in ("manifest.json", "model.onnx"):
        (tmp_path / name).write_bytes((tiny_artifact / name).read_bytes())
    (tmp_path / "model.onnx").write_bytes((tmp_path / "model.onnx").read_bytes() + b"\0")
    with pytest.raises(EngineError, match="sha256"):
        Engine(tmp_path)


def test_physical_cores_is_positive():
    assert physical_cores() >= 1
