"""Engine start-up: artifact verification and provider selection (tested on CPU; CUDA paths by simulation)."""

import numpy as np
import pytest

from addnorm.model.runtime import ProviderError, resolve_providers
from addnorm.service.backend import engine as engine_mod
from addnorm.service.backend.cores import physical_cores
from addnorm.service.backend.engine import CPU, CUDA, Engine, EngineError


@pytest.mark.parametrize(
    ("requested", "available", "expected"),
    [
        ("cpu", [CUDA, CPU], [CPU]),
        ("auto", [CUDA, CPU], [CUDA, CPU]),
        ("auto", [CPU], [CPU]),
        ("cuda", [CUDA, CPU], [CUDA, CPU]),
    ],
)
def test_provider_resolution(requested, available, expected):
    assert resolve_providers(requested, available) == expected


def test_a_new_execution_provider_is_a_row_of_the_table():
    """model.runtime.PROVIDERS is the one place a provider is named: a row for OpenVINO (setting, onnxruntime's
    name, how to install it, its options) makes --providers openvino resolve, auto prefer it where onnxruntime
    offers it, and its absence an error that says how to have it."""
    from addnorm.model.runtime import PROVIDERS, Provider

    openvino = "OpenVINOExecutionProvider"
    table = (
        Provider("openvino", openvino, "pip install onnxruntime-openvino", {"device_type": "CPU"}),
        *PROVIDERS,
    )
    assert resolve_providers("openvino", [openvino, CPU], table) == [openvino, CPU]
    assert resolve_providers("auto", [openvino, CPU], table) == [openvino, CPU]
    assert resolve_providers("auto", [CPU], table) == [CPU]
    with pytest.raises(ProviderError, match="pip install onnxruntime-openvino"):
        resolve_providers("openvino", [CPU], table)
    with pytest.raises(ProviderError, match="use auto, openvino, cuda, cpu"):
        resolve_providers("tpu", [CPU], table)


def test_cuda_never_falls_back_silently():
    with pytest.raises(ProviderError, match="onnxruntime-gpu|GPU build"):
        resolve_providers("cuda", [CPU])
    with pytest.raises(ProviderError, match="unknown providers"):
        resolve_providers("tpu", [CPU])


def test_cuda_that_fails_to_initialize_is_refused(tiny_artifact, monkeypatch):
    """onnxruntime drops CUDA with only a warning when its libraries fail to load: the engine must not."""
    monkeypatch.setattr(engine_mod.ort, "get_available_providers", lambda: [CUDA, CPU])
    real_session = engine_mod.ort.InferenceSession

    def session(path, opts, providers, **kwargs):  # what onnxruntime does when CUDA cannot start
        return real_session(path, opts, providers=[CPU], **kwargs)

    monkeypatch.setattr(engine_mod.ort, "InferenceSession", session)
    with pytest.raises(EngineError, match="Refusing to fall back"):
        Engine(tiny_artifact, "cuda")
    assert Engine(tiny_artifact, "auto").providers == [CPU]  # auto: warns and serves on CPU


def test_a_cuda_engine_makes_no_light_session(tiny_artifact, monkeypatch):
    """--intra-op-spinning light (the default) on CUDA: the GPU runs the model and the CPU pool idles, so there is
    one session, and a run at light load takes it; GET /v1/model says its threads do not spin."""
    monkeypatch.setattr(engine_mod.ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.delattr(engine_mod.ort, "preload_dlls", raising=False)
    real_session, made = engine_mod.ort.InferenceSession, []

    class OnCuda:  # a CPU session that says what a working CUDA one says
        def __init__(self, path, opts, providers, **kwargs):
            made.append(providers)
            self.inner = real_session(path, opts, providers=[CPU], **kwargs)

        def get_providers(self):
            return [CUDA, CPU]

        def run(self, *args):
            return self.inner.run(*args)

    monkeypatch.setattr(engine_mod.ort, "InferenceSession", OnCuda)
    eng = Engine(tiny_artifact, "cuda", spinning="light")
    assert len(made) == 1 and eng.light_session is None
    assert eng.describe()["intra_op_spinning"] == "off"
    x = np.ones((1, 3, 32), np.float32)
    np.testing.assert_array_equal(eng.run(x, light=True)["encoded"], eng.run(x)["encoded"])


def test_cpu_sessions_keep_add_and_layer_norm_apart(tiny_artifact, tmp_path, monkeypatch):
    """A CPU engine is made without onnxruntime's SkipLayerNormFusion (slower on CPU: model.runtime), a CUDA one
    with it; the name is one onnxruntime knows: its optimized graph keeps LayerNormalization instead of fusing."""
    import onnx
    import onnxruntime as ort

    from addnorm.model.runtime import CPU_DISABLED_OPTIMIZERS, disabled_optimizers

    made = []
    real_session = engine_mod.ort.InferenceSession

    def session(path, opts, providers, **kwargs):
        made.append(kwargs)
        return real_session(path, opts, providers=[CPU], **kwargs)

    monkeypatch.setattr(engine_mod.ort, "InferenceSession", session)
    Engine(tiny_artifact, "cpu")
    assert made[-1]["disabled_optimizers"] == list(CPU_DISABLED_OPTIMIZERS) == ["SkipLayerNormFusion"]
    assert disabled_optimizers(CUDA) == []
    ops = {}
    for name, disabled in (("defaults", None), ("served", disabled_optimizers(CPU))):
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        real_session(str(tiny_artifact / "model.onnx"), opts, providers=[CPU], disabled_optimizers=disabled)
        ops[name] = {n.op_type for n in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node}
    assert "SkipLayerNormalization" in ops["defaults"] and "LayerNormalization" not in ops["defaults"]
    assert "SkipLayerNormalization" not in ops["served"] and "LayerNormalization" in ops["served"]


def test_engine_runs_the_graph_and_answers_by_output_name(tiny_artifact):
    """The engine's outputs, by name, equal PyTorch on the artifact's own weights; padding changes nothing else."""
    import torch

    from addnorm.export.weights import load_weights
    from addnorm.model.encoder import Encoder

    eng = Engine(tiny_artifact, "cpu", intra_op_threads=1)
    assert eng.providers == [CPU] and eng.d_model == 32 and eng.threads == 1
    torch_model = load_weights(Encoder(eng.manifest.config), tiny_artifact / "weights.safetensors")
    x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    mask[1, 3:] = True
    out = eng.run(x, mask)
    assert list(out) == ["encoded"] and out["encoded"].dtype == np.float32
    with torch.no_grad():
        want = torch_model(torch.from_numpy(x), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(out["encoded"], want, atol=1e-5, rtol=1e-4)
    short = eng.run(x[1:, :3])["encoded"]  # the padded row's real tokens, unpadded
    np.testing.assert_allclose(out["encoded"][1, :3], short[0], atol=1e-5, rtol=1e-4)


def test_intra_op_spinning_in_run_spins_within_a_run_and_stops_after_it(tiny_artifact):
    """--intra-op-spinning (light, the default: the next test): off lets no pool thread spin; in-run lets them spin between a run's
    parallel sections and stops them when it ends (onnxruntime's force_spinning_stop). The same arithmetic."""
    from addnorm.service.settings import Settings

    assert Settings.model_fields["intra_op_spinning"].default == "light"
    with pytest.raises(ValueError, match="'alone' is now 'light'"):  # its old name, answered with the new one
        Settings(intra_op_spinning="alone")
    x = np.random.default_rng(0).standard_normal((3, 7, 32)).astype(np.float32)
    answers = {}
    for spinning, allow, stop in (("off", "0", ""), ("in-run", "1", "1")):
        eng = Engine(tiny_artifact, "cpu", intra_op_threads=2, spinning=spinning)
        opts = eng.session.get_session_options()
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == allow, spinning
        if stop:
            assert opts.get_session_config_entry("session.force_spinning_stop") == stop
        else:
            with pytest.raises(RuntimeError, match="does not have configuration"):
                opts.get_session_config_entry("session.force_spinning_stop")
        answers[spinning] = eng.run(x)["encoded"]
    np.testing.assert_array_equal(answers["off"], answers["in-run"])


def test_intra_op_spinning_light_spins_only_in_runs_at_light_load(tiny_artifact):
    """--intra-op-spinning light: a second session of the same graph, spinning within a run, takes the runs the
    batcher marks light; every other run and the idle release stay on the first, whose threads never spin. The
    same arithmetic on both. On no CPU provider, and with off or in-run, there is no second session."""
    x = np.random.default_rng(1).standard_normal((2, 5, 32)).astype(np.float32)
    eng = Engine(tiny_artifact, "cpu", intra_op_threads=2, spinning="light")
    opts = eng.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    spin = eng.light_session.get_session_options()
    assert spin.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert spin.get_session_config_entry("session.force_spinning_stop") == "1"
    np.testing.assert_array_equal(eng.run(x, light=True)["encoded"], eng.run(x)["encoded"])
    calls = []
    for name in ("session", "light_session"):
        session = getattr(eng, name)
        setattr(
            eng,
            name,
            type(
                "Spy",
                (),
                {"run": lambda s, *a, name=name, inner=session: calls.append(name) or inner.run(*a)},
            )(),
        )
    eng.run(x, light=True)
    eng.run(x)
    eng._grown = 1
    assert eng.release()
    assert calls == [
        "light_session",
        "session",
        "session",
        "light_session",
    ]  # the release shrinks both sessions' arenas
    assert eng.describe()["intra_op_spinning"] == "light"  # GET /v1/model says what its runs do
    for spinning in ("off", "in-run"):
        other = Engine(tiny_artifact, "cpu", intra_op_threads=2, spinning=spinning)
        assert other.light_session is None and other.describe()["intra_op_spinning"] == spinning


def test_parallel_runs_give_loaded_runs_one_thread_each_and_light_runs_every_thread(tiny_artifact):
    """--parallel-runs on (the server's default; the Engine's is off): on 2 threads, two lanes; the runs under load
    go to a session of one thread (run by the lanes at once), the runs at light load to one of every thread,
    spinning within the run with --intra-op-spinning light, asleep with off. The same arithmetic on both, from two
    threads at once too. One thread, or off: one lane, as before."""
    from concurrent.futures import ThreadPoolExecutor

    from addnorm.service.settings import Settings

    assert Settings.model_fields["parallel_runs"].default == "on"
    x = np.random.default_rng(2).standard_normal((3, 6, 32)).astype(np.float32)
    for spinning, spins in (("light", "1"), ("off", "0")):
        eng = Engine(tiny_artifact, "cpu", intra_op_threads=2, spinning=spinning, parallel_runs=True)
        assert eng.lanes == 2 and eng.threads == 2 and eng.describe()["parallel_runs"] == 2
        assert eng.session.get_session_options().intra_op_num_threads == 1
        light = eng.light_session.get_session_options()
        assert light.intra_op_num_threads == 2
        assert light.get_session_config_entry("session.intra_op.allow_spinning") == spins
        want = eng.run(x, light=True)["encoded"]
        with ThreadPoolExecutor(2) as pool:
            for got in pool.map(lambda _, e=eng: e.run(x)["encoded"], range(8)):
                np.testing.assert_array_equal(got, want)
    assert Engine(tiny_artifact, "cpu", intra_op_threads=1, parallel_runs=True).lanes == 1
    assert Engine(tiny_artifact, "cpu", intra_op_threads=2, spinning="light").lanes == 1


def test_engine_refuses_a_tampered_graph(tiny_artifact, tmp_path):
    for name in ("manifest.json", "model.onnx"):
        (tmp_path / name).write_bytes((tiny_artifact / name).read_bytes())
    (tmp_path / "model.onnx").write_bytes((tmp_path / "model.onnx").read_bytes() + b"\0")
    with pytest.raises(EngineError, match="sha256"):
        Engine(tmp_path)


CPUINFO_2_CORES_4_THREADS = "".join(
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\n\n" for cpu in range(4)
)


def test_physical_cores_counts_cores_not_hyperthreads():
    assert physical_cores(CPUINFO_2_CORES_4_THREADS, {0, 1, 2, 3}) == 2
    assert physical_cores(CPUINFO_2_CORES_4_THREADS, {0, 2}) == 1  # two threads of one core
    assert physical_cores(CPUINFO_2_CORES_4_THREADS, {0, 1}) == 2
    assert physical_cores("", {0, 1, 2}) == 3  # no topology (containers, other arches): affinity decides
    assert physical_cores() >= 1


def test_default_threads_respect_the_container_cpu_quota(tmp_path):
    from addnorm.service.backend.cores import cpu_quota, default_threads

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("200000 100000\n")  # 2 CPUs
    assert cpu_quota(v2) == 2.0
    assert default_threads(1, cores=64, quota=cpu_quota(v2)) == 2
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None and default_threads(2, cores=64, quota=None) == 32
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")  # 1.5 CPUs: round up, never below one
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path / "v1") == 1.5 and default_threads(1, cores=64, quota=1.5) == 2
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path / "v1") is None
    assert cpu_quota(tmp_path / "nothing") is None
    assert default_threads(4, cores=2, quota=None) == 1


def test_long_runs_give_their_memory_back(tiny_artifact, monkeypatch):
    """A run above SHRINK_EACH_ABOVE_BYTES shrinks the arena and trims the heap as it ends; one above
    RELEASE_ABOVE_BYTES leaves that to ``release`` (the batcher calls it once the model is idle), which gives it
    back RELEASES times per such run (the second: what requests being answered held at the first); ordinary runs keep
    the arena warm. The padded run holds the mha form's seq x seq
    tensors (flash attention otherwise): more working memory for the same shape."""
    from addnorm.service.backend import engine

    eng = Engine(tiny_artifact, "cpu", intra_op_threads=1)
    assert eng.attention == "mha"
    trims = []
    monkeypatch.setattr(engine, "trim", lambda: trims.append(1))
    seq = 300
    plain, padded = eng.working_bytes(1, seq, False), eng.working_bytes(1, seq, True)
    assert padded == plain + 4 * eng.heads * seq * seq
    monkeypatch.setattr(engine, "RELEASE_ABOVE_BYTES", plain - 1)
    monkeypatch.setattr(engine, "SHRINK_EACH_ABOVE_BYTES", padded - 1)
    x = np.zeros((1, seq, 32), np.float32)
    eng.run(x[:, :100])
    assert trims == [] and eng.release() is False  # ordinary: nothing to give back
    eng.run(x)
    assert trims == []  # kept until the model is idle
    assert engine.RELEASES == 2
    assert eng.release() is True and trims == [1]
    assert eng.release() is True and trims == [1, 1]
    assert eng.release() is False and trims == [1, 1]  # twice per such run
    mask = np.zeros((1, seq), bool)
    mask[0, -1] = True
    out = eng.run(x, mask)["encoded"]
    assert (
        trims == [1, 1, 1] and out.shape == (1, seq, 32) and np.isfinite(out).all()
    )  # given back as it ended


# --- loading exactly what was verified (issue 36) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_versions(tiny_artifact, tmp_path_factory):
    """(directory, the other graph's bytes, x, its answer, the other's answer): the tiny artifact copied, and the
    same block with other weights."""
    import shutil

    from addnorm.model.artifact import MODEL_FILE
    from tests.conftest import TINY, export_to

    root = tmp_path_factory.mktemp("versions")
    other = export_to(root / "other", TINY, seed=5)
    x = np.linspace(-1, 1, 3 * 32, dtype=np.float32).reshape(1, 3, 32)
    want = Engine(tiny_artifact, "cpu", 1).run(x)["encoded"]
    wrong = Engine(other, "cpu", 1).run(x)["encoded"]
    assert np.abs(want - wrong).max() > 0.1
    return root, tiny_artifact, (other / MODEL_FILE).read_bytes(), x, want, shutil


def test_the_graph_onnxruntime_gets_is_the_one_whose_sha256_was_checked(two_versions, monkeypatch):
    """The graph on disk replaced after its sha256 matched and before onnxruntime is given it (the window that
    reading the file twice had): the engine still runs the verified graph."""
    import onnxruntime as ort

    from addnorm.model.artifact import MODEL_FILE

    root, artifact, theirs, x, want, shutil = two_versions
    directory = root / "swapped-after-check"
    shutil.copytree(artifact, directory)
    real = ort.InferenceSession

    def swap_then_load(model, *args, **kwargs):
        (directory / MODEL_FILE).write_bytes(theirs)  # another version lands now, after the check
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine_mod.ort, "InferenceSession", swap_then_load)
    np.testing.assert_allclose(Engine(directory, "cpu", 1).run(x)["encoded"], want, atol=1e-6)
    monkeypatch.undo()
    with pytest.raises(EngineError, match="sha256 of .* is being replaced"):  # and a later load refuses it
        Engine(directory, "cpu", 1)


def test_a_directory_rewritten_while_it_loads_is_never_served_as_another_version(two_versions):
    """A thread keeps replacing model.onnx (whole files swapped in, and half-written ones) and golden.safetensors
    (half-written) while the engine loads again and again: each load either refuses (sha256) or runs exactly the
    verified graph, and its golden check passes."""
    import os
    import threading

    from addnorm.model.artifact import GOLDEN_FILE, MODEL_FILE
    from addnorm.service.backend.engine import verify_engine

    root, artifact, theirs, x, want, shutil = two_versions
    directory = root / "rewritten"
    shutil.copytree(artifact, directory)
    mine, golden = (directory / MODEL_FILE).read_bytes(), (directory / GOLDEN_FILE).read_bytes()
    versions = [theirs, mine, mine[: len(mine) // 2], mine]
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            data = versions[i % len(versions)]
            (directory / ".next").write_bytes(data)
            os.replace(directory / ".next", directory / MODEL_FILE)  # a whole file swapped in
            (directory / GOLDEN_FILE).write_bytes(golden[: len(golden) // 2] if i % 3 == 0 else golden)
            i += 1

    thread = threading.Thread(target=rewrite, daemon=True)
    thread.start()
    outcomes = {"loaded": 0, "refused": 0}
    try:
        for _ in range(15):
            try:
                engine = Engine(directory, "cpu", 1)
            except EngineError as exc:
                assert "sha256" in str(exc) or "missing" in str(exc), exc
                outcomes["refused"] += 1
                continue
            outcomes["loaded"] += 1
            np.testing.assert_allclose(engine.run(x)["encoded"], want, atol=1e-6)
            assert verify_engine(engine, "strict").status == "passed"
    finally:
        stop.set()
        thread.join(10)
    print("loads while the directory was rewritten:", outcomes)


def test_the_server_freezes_what_it_built_before_serving_and_models_stay_collectable(monkeypatch):
    """``freeze_heap`` (addnorm-serve, before it serves): what exists then leaves the cyclic collector's passes
    (a full pass of a serving process took 45-70 ms, docs/benchmarks.md); a cycle made afterwards, as a model
    swapped out is, is still collected."""
    import gc
    import weakref

    import uvicorn

    from addnorm.service import cli

    frozen_when_serving = []
    monkeypatch.setattr(
        uvicorn.Server, "run", lambda self, sockets=None: frozen_when_serving.append(gc.get_freeze_count())
    )
    try:
        cli._run(object(), host="127.0.0.1", port=0)
        assert frozen_when_serving and frozen_when_serving[0] > 1000, frozen_when_serving

        class Later:
            pass

        cycle = Later()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
