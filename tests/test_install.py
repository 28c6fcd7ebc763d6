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
        ("bench.cli", "addnorm-bench"),
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
