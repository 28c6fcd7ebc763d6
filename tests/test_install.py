"""A serving-only install (no torch): the service runs; the export-side commands say what to install."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

# What a serving-only install looks like from Python: torch cannot be imported.
NO_TORCH = "import sys; sys.modules['torch'] = None; "


@pytest.mark.parametrize(
    ("entry", "command"),
    [
        ("addnorm.export.cli", "addnorm-export"),
        ("addnorm.export.parity_cli", "addnorm-parity"),
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
    assert r.returncode == 0 and "--artifact" in r.stdout


def test_the_wheel_installs_one_name_addnorm(tmp_path):
    """Issue 66: ``python -m build`` makes the sdist and the wheel; the wheel holds one top-level package, addnorm
    (the repository's model/, export/ and service/ as addnorm.model, .export, .service; bench/ and tests/ are
    checkout tools) with complete metadata, and installed into a clean venv it puts nothing else at the top of
    site-packages; its console scripts resolve inside it."""
    import zipfile

    source = (
        tmp_path / "src"
    )  # the checkout's files as git sees them: no build/ or egg-info of an editable install
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    r = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("addnorm-*.whl")
    assert list((tmp_path / "dist").glob("addnorm-*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    metadata = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    )
    fields = [line.split(": ", 1)[0] for line in metadata.splitlines() if ": " in line]
    assert {"License-Expression", "License-File", "Classifier", "Requires-Python", "Keywords"} <= set(fields)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    base = [
        line for line in metadata.splitlines() if line.startswith("Requires-Dist") and "extra ==" not in line
    ]
    assert base and not [d for d in base if any(p in d for p in ("torch", "ray", "opentelemetry"))], base
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"addnorm"}
    assert {
        "addnorm/py.typed",
        "addnorm/model/kernels/int8.cc",
        "addnorm/service/protocols/v2/inference.proto",
    } <= set(names)
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    scripts = [line.split(" = ")[1] for line in entry_points.splitlines() if " = " in line]
    assert scripts and all(s.startswith("addnorm.") for s in scripts), scripts

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    before = {p.name for p in site.iterdir()}
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    added = {p.name for p in site.iterdir()} - before
    assert {n for n in added if not n.endswith(".dist-info")} == {"addnorm"}, added
    # from outside the checkout: the installed copy, its version, a module that needs nothing but the standard library
    r = subprocess.run(
        [python, "-c", "import addnorm, addnorm.model.config as c; print(addnorm.__version__, c.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    version, where = r.stdout.split()
    assert r.returncode == 0 and version == "0.1.0" and where.startswith(str(site / "addnorm" / "model")), r
    # every command tells its version in this install too, which has none of the extras (nor the base's packages)
    for command in ("addnorm-export", "addnorm-parity", "addnorm-serve", "addnorm-triton"):
        r = subprocess.run([venv / "bin" / command, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"{command} 0.1.0", (command, r.stdout, r.stderr)


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


@pytest.mark.parametrize(
    "command",
    [
        ["addnorm-export"],
        ["addnorm-parity"],
        ["addnorm-serve"],
        ["addnorm-triton"],
        ["python", "-m", "bench"],
        ["python", "-m", "addnorm.model.kernels"],
    ],
    ids=lambda c: " ".join(c),
)
def test_every_command_tells_its_version(command):
    """Issue 66: --version on every command, the installed distribution's version."""
    from importlib import metadata

    bin_dir = Path(sys.executable).parent
    argv = [sys.executable, *command[1:]] if command[0] == "python" else [str(bin_dir / command[0])]
    r = subprocess.run([*argv, "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"{' '.join(command)} {metadata.version('addnorm')}", r
