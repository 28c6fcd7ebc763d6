"""Shared fixtures: a tiny model exported once per session, and a real uvicorn server on a free port."""

from __future__ import annotations

import fcntl
import logging
import os
import resource
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from addnorm.model.config import EncoderConfig
from bench.server import ROOT, ServerProcess

__all__ = ["ROOT", "SMALL", "TINY", "export_to", "start_server"]
# Apps the tests build in-process serve no gRPC unless a test asks for a port (the default, 8001, could be taken).
os.environ["ADDNORM_GRPC_PORT"] = "0"
TINY = EncoderConfig(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0)
SMALL = EncoderConfig(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0)


def export_to(out: Path, config: EncoderConfig, **kwargs) -> Path:
    from addnorm.export.pipeline import export_artifact, prepare_encoder

    export_artifact(
        prepare_encoder(config, kwargs.pop("checkpoint", None), seed=kwargs.pop("seed", 0)), out, **kwargs
    )
    return out


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """``make(out)`` once per test run, not once per pytest-xdist worker: the first worker to ask makes it in the
    workers' common temporary directory while the others wait on a file lock, then read it (pytest-xdist's documented
    way to share a session fixture). What a failed attempt left is removed and the next asker tries again. For
    read-only data: a test that changes one works on its own copy."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/, above each worker's popen-gwK/
    out = base / "shared" / name
    out.parent.mkdir(exist_ok=True)
    with (out.parent / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
    return out


@pytest.fixture(scope="module")
def one_trace_per_model() -> Iterator[None]:
    """One ``traces.reusing()`` scope for a whole test module (export/traces.py): every graph of one model, dtype,
    opset and attention form is traced once, and the gate's torch-side results computed once, however many of the
    module's exports ask. A module opts in (``pytestmark = pytest.mark.usefixtures("one_trace_per_model")``) only
    where no test patches code a trace or a gate runs: a changed weight or module attribute is another key, a patched
    function is not."""
    from addnorm.export import traces

    with traces.reusing():
        yield


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer post-norm artifact (d_model 32), exported and parity-gated once a run."""
    return once_per_run(tmp_path_factory, "tiny", lambda out: export_to(out, TINY))


TINY_TEXT_MODEL = "tiny-text-model"  # the model directory tiny_text_artifact is exported from, beside it


@pytest.fixture(scope="session")
def tiny_text_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT's ids artifact (random weights, tests/text_models.py), named "tiny", exported once a run, for the
    tests that only read it."""
    from addnorm.export import cli as export_cli
    from tests.text_models import make_model_dir

    def make(out: Path) -> None:
        model_dir = make_model_dir("bert", out.parent / TINY_TEXT_MODEL)
        assert (
            export_cli.main(["--from", str(model_dir), "--artifact", str(out), "--name", "tiny", "-q"]) == 0
        )

    return once_per_run(tmp_path_factory, "tiny-text", make)


@pytest.fixture(scope="session")
def default_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default block (d_model 768, 12 heads, feed-forward 3072, mha attention), as make serve exports it, once
    a run."""
    return once_per_run(tmp_path_factory, "default", lambda out: export_to(out, EncoderConfig(dropout=0.0)))


@pytest.fixture(scope="session")
def model_repository(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of two models, as --model-repository reads it: the tiny fp32 artifact ("encoder") and the
    same block in int8 under another name ("encoder-int8"), different seeds so their answers differ."""
    import shutil

    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(tiny_artifact, repo / "a-fp32")
    export_to(repo / "b-int8", TINY, name="encoder-int8", variant="int8", seed=1)
    return repo


REPO_KEY = "repo-secret"


@pytest.fixture(scope="session")
def repo_server(model_repository: Path) -> Iterator[ServerProcess]:
    """addnorm-serve --model-repository on the two models: HTTP and gRPC (``.grpc_port``), API key REPO_KEY,
    a 200 kB body limit."""
    args = ["-m", "addnorm.service", "--model-repository", str(model_repository), "--api-key", REPO_KEY]
    with ServerProcess([*args, "--max-body-bytes", "200000"], grpc=True) as srv:
        yield srv


def start_server(model_dir: Path, *extra: str, grpc: bool = False) -> ServerProcess:
    """addnorm-serve on ``model_dir`` in its own process (not yet waited for; ``with`` waits and stops it);
    ``grpc``: with its gRPC service on a free port (``.grpc_port``)."""
    return ServerProcess(["-m", "addnorm.service", "--artifact", str(model_dir), *extra], grpc=grpc)


@pytest.fixture(scope="session")
def server(tiny_artifact: Path) -> Iterator[str]:
    """A real uvicorn process serving the tiny artifact; yields its base URL."""
    with start_server(tiny_artifact, "--max-queue-delay-ms", "1") as srv:
        yield srv.base


@pytest.fixture(autouse=True)
def _addnorm_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """service.logs.configure stops "addnorm" records at its own handler, and the export CLI raises its level;
    tests read them with caplog."""
    monkeypatch.setattr(logging.getLogger("addnorm"), "propagate", True)
    caplog.set_level(logging.INFO, logger="addnorm")


def pytest_report_header() -> str:
    """The CPU kind every numerical verdict of this run holds on (docs/parity.md names runs by it)."""
    from addnorm.model.runtime import cpu_flags

    return f"CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's share of the cores for torch's OpenMP and numpy's BLAS (which read
    OMP_NUM_THREADS when they start; the workers inherit it), unless OMP_NUM_THREADS is set. Two workers of two
    threads each on two cores spend much of their time in OpenMP's spin-waits: test_real_model and test_matrix side
    by side took 412 s with it, 287 s with one thread each (2-core AVX2 EPYC, 2026-11-27)."""
    workers = getattr(config.option, "numprocesses", None)
    cores = len(os.sched_getaffinity(0))
    workers = cores if workers in ("auto", "logical") else workers
    if isinstance(workers, int) and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    if not hasattr(config, "workerinput"):  # once, before any worker starts
        _build_kernels()


def _build_kernels() -> None:
    """int8's kernel library (model/kernels) for this source, as make serve builds it: ``auto`` picks it on every
    CPU with AVX2 and FMA, so every engine and export gate of the run registers it and int8 is tested as it is
    served. A CPU without AVX2 and FMA cannot run it (the suite then tests int8's standard operators only); anywhere
    else a failed build fails the run."""
    from addnorm.model import kernels

    if kernels.cpu_lacks():
        return
    try:
        kernels.build()
    except kernels.KernelError as exc:
        raise pytest.UsageError(
            f"cannot build int8's kernels (python -m addnorm.model.kernels): {exc}"
        ) from exc


LANES = {"model": "unit", "service": "unit", "export": "export"}  # tests/<dir>/...; top-level files: server


# The files that take minutes, longest first (make test on a 2-core EPYC, 2026-12-02: test_readme.py's one test
# 255 s as the guides grew; the longest fixtures: test_real_model.py's 82-93 s, test_text_real.py's 70-102 s,
# test_matrix.py's 58-65 s): make test hands them to its workers before the rest (--no-loadscope-reorder keeps
# this order), so no worker starts one of them while the others are finishing.
LONGEST_FIRST = (
    "test_readme.py",
    "test_real_model.py",
    "test_text_real.py",
    "test_matrix.py",
    "test_families.py",
    "test_variants.py",
    "test_ray_serve.py",
    "test_attention.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's lane by its path: ``make test-fast`` runs the unit lane (``-m unit``); the longest files first."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the rest, and each file's tests, keep their order
    items.sort(key=lambda item: rank.get(Path(item.fspath).name, len(rank)))
    tests = Path(__file__).parent
    for item in items:
        parts = Path(item.fspath).relative_to(tests).parts
        lane = LANES.get(parts[0], "server") if len(parts) > 1 else "server"
        if parts[-1] == "test_ray_serve.py":
            lane = "cluster"
        item.add_marker(getattr(pytest.mark, lane))


# What .ci/run installs with apt where it can. In CI (CI=true, which .ci/run sets) a test skipped for want of one
# fails instead: an install that failed must not turn into a green run that checked less. Elsewhere the skip
# stands and its reason names the package that installs it.
IN_CI = os.environ.get("CI", "").lower() == "true"
CI_TOOLS = ("qemu", "chromium", "docker-compose", "podman", "debootstrap", "nginx", "strace")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(tool in reason for tool in CI_TOOLS):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where .ci/run installs what it needs: {reason}"


# The suite's CPU by test file, printed at its end: this process's and the processes its tests waited for (servers,
# exports, Ray's), as each file's tests and their fixtures' set-up and tear-down took it. make test must stay under
# 15 minutes on 2 cores, where the suite is bound by CPU, not by waiting: these are the figures to cut by.
_CPU_BY_FILE: dict[str, float] = {}


def _cpu_s() -> float:
    return sum(
        u.ru_utime + u.ru_stime
        for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = _cpu_s()
    yield
    path = Path(item.fspath)
    name = (
        path.relative_to(Path(__file__).parent).as_posix()
        if path.is_relative_to(Path(__file__).parent)
        else str(path)
    )
    _CPU_BY_FILE[name] = _CPU_BY_FILE.get(name, 0.0) + _cpu_s() - start


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its figures go to the controller
        session.config.workeroutput["cpu_by_file"] = _CPU_BY_FILE


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: a worker's figures, added to the others'."""
    for name, cpu in getattr(node, "workeroutput", {}).get("cpu_by_file", {}).items():
        _CPU_BY_FILE[name] = _CPU_BY_FILE.get(name, 0.0) + cpu


def pytest_terminal_summary(terminalreporter) -> None:
    if not _CPU_BY_FILE:
        return
    total = sum(_CPU_BY_FILE.values())
    top = sorted(_CPU_BY_FILE.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", f"CPU by test file: {total:.0f} s in all, the {len(top)} largest")
    for name, cpu in top:
        terminalreporter.write_line(f"{cpu:8.1f} s  {cpu / total:5.1%}  {name}")
