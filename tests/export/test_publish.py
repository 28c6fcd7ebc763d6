"""Publishing an artifact (export/publish.py): whatever instant the export dies, the directory holds the previous
complete artifact or the new one; what dead exports left is removed; a failed write is one error line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from addnorm.model.artifact import read_verified
from tests.conftest import ROOT, TINY, export_to

# the same tiny blocks exported again and again (a re-export, a dead export's successor, the exports nobody kills):
# one trace of each; the one patch here is the weights' save, after the trace
pytestmark = [pytest.mark.export, pytest.mark.usefixtures("one_trace_per_model")]

TINY_FLAGS = ["--d-model", "32", "--nhead", "4", "--dim-feedforward", "64", "-q"]


def _export_cmd(out: Path, seed: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "addnorm.export.cli",
        "--artifact",
        str(out),
        "--weights-seed",
        str(seed),
        *TINY_FLAGS,
    ]


def _whole(directory: Path) -> str:
    """The sha256 of the graph of the complete, verified artifact in ``directory`` (fails on anything else)."""
    return read_verified(directory).manifest.model_sha256


def _staging_left(out: Path) -> list[str]:
    return sorted(p.name for p in [*out.parent.glob(f".{out.name}.staging-*"), *out.glob(".staging-*")])


def test_a_re_export_swaps_the_artifact_keeps_the_rest_and_leaves_no_staging(tmp_path):
    out = export_to(tmp_path / "art", TINY)
    first = _whole(out)
    (out / "report").mkdir()
    (out / "report" / "parity.md").write_text("kept")
    export_to(out, TINY, seed=1)
    assert _whole(out) != first
    assert (out / "report" / "parity.md").read_text() == "kept"
    assert _staging_left(out) == []


def test_what_a_dead_export_left_is_removed_by_the_next(tmp_path):
    out = export_to(tmp_path / "art", TINY)
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    stale = [tmp_path / f".art.staging-{dead.pid}-abc", out / f".staging-{dead.pid}-def"]
    for path in stale:
        path.mkdir()
        (path / "model.onnx").write_bytes(b"partial")
    export_to(out, TINY, seed=1)
    assert _staging_left(out) == []


def _strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    return found


def _killed_at(strace: str, out: Path, seed: int, syscall: str, when: int) -> subprocess.CompletedProcess:
    inject = f"inject={syscall}:signal=KILL:when={when}"
    cmd = [strace, "-qq", "-e", f"trace={syscall}", "-e", inject, "-o", "/dev/null", *_export_cmd(out, seed)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_an_export_killed_at_each_step_of_its_publish_leaves_one_whole_artifact(tmp_path):
    """SIGKILL at the swap (before it: the previous artifact), at the directory's sync after it (the new one), and
    for a first export at its one rename (no artifact, nothing half there); the next export cleans up and
    publishes."""
    from addnorm.export import cli

    strace = _strace()
    out = tmp_path / "art"
    assert cli.main(_export_cmd(out, 0)[3:]) == 0  # the exports nobody kills run in this process
    before = _whole(out)
    # where the swap falls among the export's fsync calls: kill at the first fsync after it
    traced = subprocess.run(
        [strace, "-qq", "-e", "trace=renameat2,fsync", "-o", str(tmp_path / "trace"), *_export_cmd(out, 1)],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    assert traced.returncode == 0, traced.stderr[-2000:]
    calls = [m[1] for m in re.finditer(r"^(\w+)\(", (tmp_path / "trace").read_text(), re.M)]
    assert "renameat2" in calls, calls
    after_swap = calls[: calls.index("renameat2")].count("fsync") + 1
    new = _whole(out)
    assert new != before
    killed = _killed_at(strace, out, 0, "renameat2", 1)
    assert killed.returncode != 0, "the export was not killed at its swap"
    assert _whole(out) == new  # killed before the swap: the previous artifact, whole
    killed = _killed_at(strace, out, 2, "fsync", after_swap)
    assert killed.returncode != 0, "the export was not killed at the sync after its swap"
    assert _whole(out) not in (new, before)  # killed after the swap: the new artifact, whole
    fresh = tmp_path / "fresh"
    done = _killed_at(strace, fresh, 0, "rename", 1)
    assert done.returncode != 0 and not fresh.exists()
    assert cli.main(_export_cmd(out, 3)[3:]) == 0
    assert _staging_left(out) == [] and _whole(out)


def test_a_write_that_fails_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """A full disk while the weights are written (safetensors' own error, an uncaught traceback and exit 1 before),
    and a directory that cannot be written: one 'error:' line naming the file, exit 2, nothing published."""
    from safetensors import SafetensorError

    from addnorm.export import cli, weights

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(weights, "save_file", full)
    out = tmp_path / "art"
    assert cli.main(["--artifact", str(out), *TINY_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: cannot write weights.safetensors")
        and "StorageFull" in err[0]
    )
    assert not (out / "manifest.json").exists() and _staging_left(out) == []
    monkeypatch.undo()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert cli.main(["--artifact", str(blocked / "art"), *TINY_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write into"), err


def test_the_manifest_of_a_swapped_artifact_is_its_own(tmp_path):
    out = export_to(tmp_path / "art", TINY)
    export_to(out, TINY, seed=1)
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["model_sha256"] == _whole(out)
