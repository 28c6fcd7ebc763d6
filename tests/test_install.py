"""A serving-only install (no torch): the service runs; the export-side commands say what to install."""

import os
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


def test_make_serve_takes_the_servers_own_variables():
    """Issue 27: ADDNORM_PORT=8100 make serve served on 8000 (the Makefile's flags won over the variables)."""
    env = {**os.environ, "ADDNORM_PORT": "8100", "ADDNORM_GRPC_PORT": "8101", "ADDNORM_HOST": "127.0.0.2"}
    r = subprocess.run(["make", "-n", "serve"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--host 127.0.0.2 --port 8100 --grpc-port 8101" in r.stdout
    r = subprocess.run(
        ["make", "-n", "serve", "PORT=8200"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert "--port 8200" in r.stdout  # make's own variable wins
