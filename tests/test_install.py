"""A serving-only install (no torch): the service runs; the export-side commands say what to install."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

# What a serving-only install looks like from Python: torch cannot be imported.
NO_TORCH = "import sys; sys.modules['torch'] = None; "


@pytest.mark.parametrize(
    ("entry", "command"),
    [
        ("export.cli", "addnorm-export"),
        ("export.parity_cli", "addnorm-parity"),
        ("bench.cli", "python -m bench"),
    ],
)
def test_export_side_commands_name_the_extra_without_torch(entry, command):
    code = NO_TORCH + f"from {entry} import main; sys.exit(main(['--help']))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no traceback
    assert (
        command in r.stderr
        and "pip install '.[export]'" in r.stderr
        and "whl/cpu" in r.stderr
        and "torch" in r.stderr
    )


def test_serve_runs_without_torch():
    code = NO_TORCH + "from service.cli import main; sys.exit(main(['--help']))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--model-dir" in r.stdout


def test_the_wheel_ships_model_export_and_service_only(tmp_path):
    """Issue 27: bench/ is a checkout tool (python -m bench), not a top-level package of the wheel; the console
    scripts the wheel declares all resolve to its own packages."""
    import zipfile

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = tmp_path.glob("addnorm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"model", "export", "service"}, tops
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "bench" not in scripts and "addnorm-serve = service.cli:main" in scripts
