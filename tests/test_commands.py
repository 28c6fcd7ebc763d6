"""Issue 66: every command speaks one vocabulary (addnorm/commands.py): the artifact directory is ``--artifact`` with
one default, ``--providers`` and ``--seed`` mean one thing with one default wherever they appear, ``--version`` and
readable defaults everywhere, the old spellings answered with the new ones."""

import argparse
import importlib
import subprocess
import sys

import pytest

from addnorm.commands import DEFAULT_ARTIFACT, Parser, readable
from addnorm.model.runtime import SETTINGS as PROVIDERS
from tests.conftest import ROOT

pytestmark = pytest.mark.unit

# Every command a user runs, by the module whose build_parser() (or main) makes its parser.
COMMANDS = {
    "addnorm-export": "addnorm.export.cli",
    "addnorm-parity": "addnorm.export.parity_cli",
    "addnorm-serve": "addnorm.service.cli",
    "addnorm-triton": "addnorm.service.protocols.v2.triton_repo",
    "python -m bench": "bench.cli",
}
# Spellings that are gone: an artifact directory has one name.
RETIRED = ("--out", "--model-dir", "--artifact-dir", "--repo-dir")


def parser_of(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(COMMANDS[command]).build_parser()


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_one_spelling_for_the_artifact_directory(command):
    parser = parser_of(command)
    flags = options(parser)
    assert "--artifact" in flags and "--version" in flags
    assert not [f for f in RETIRED if f in flags]
    assert not [a.dest for a in parser._actions if not a.option_strings]  # no positional directories
    if command == "addnorm-serve":  # the settings decide: none given serves the default artifact
        from addnorm.service.models.registry import artifact_dirs
        from addnorm.service.settings import Settings

        assert artifact_dirs(Settings()) == (DEFAULT_ARTIFACT,)
    else:
        assert str(
            parser.parse_args([] if command != "addnorm-triton" else ["--model-repository", "r"]).artifact
        ) == str(DEFAULT_ARTIFACT)


@pytest.mark.parametrize("command", COMMANDS)
def test_shared_flags_mean_one_thing(command):
    from addnorm.export.parity import SEED
    from addnorm.service.settings import Settings

    flags = options(parser_of(command))
    if "--providers" in flags:
        default = (
            Settings.model_fields["providers"].default
            if command == "addnorm-serve"
            else flags["--providers"].default
        )
        assert tuple(flags["--providers"].choices) == PROVIDERS and default == "auto"
    if "--seed" in flags:  # the gate's random inputs, as the export's gate draws them
        assert flags["--seed"].default == SEED
    if "--json" in flags:  # the full parity report; -q and -v beside it
        assert {"-q", "-v"} <= set(flags) and "full parity report" in flags["--json"].help


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_defaults_as_a_user_reads_them(command):
    text = " ".join(parser_of(command).format_help().split())
    for python in ("default ()", "default None", "default False", "default True", "default []", "(default: "):
        assert python not in text, python


def test_readable_defaults():
    assert [readable(v) for v in ((), None, False, True, [1, 8], 0.5)] == [
        "none",
        "none",
        "off",
        "on",
        "1 8",
        "0.5",
    ]
    parser = Parser(prog="x")
    parser.add_argument("--count", type=int, default=0, help="a count")  # 0 == False, yet a default to show
    assert "a count (default 0)" in " ".join(parser.format_help().split())


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["-m", "addnorm.service.cli", "--model-dir", "x"], "--model-dir is now --artifact"),
        (["-m", "addnorm.export.parity_cli", "--out", "x"], "--out is now --artifact"),
        (["-m", "addnorm.export.cli", "--seed", "3"], "--seed is now --weights-seed"),
        (["-m", "addnorm.service.cli", "--intra-op-spinning", "alone"], "'alone' is now 'light'"),
    ],
)
def test_an_old_spelling_is_answered_with_the_new_one(argv, hint):
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and hint in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_old_variable_is_refused_by_name(monkeypatch):
    from pydantic import ValidationError

    from addnorm.service.settings import Settings, explain

    monkeypatch.setenv("ADDNORM_MODEL_DIR", "x")
    with pytest.raises(ValidationError) as exc:
        Settings()
    assert explain(exc.value) == "ADDNORM_MODEL_DIR: renamed, set ADDNORM_ARTIFACT instead"
