"""The vocabulary every addnorm command shares (addnorm-export, -parity, -serve, -triton, python -m bench and the
modules' own commands): one spelling for each thing and one default, ``--version`` on each, a usage error in one
line that names a renamed flag's new name, and no dependency's progress bars. tests/test_commands.py holds every
command to it; a new command takes its parser from here (``Parser``) and its shared flags from the ``add_*``
functions."""

from __future__ import annotations

import argparse
import os
import re
import sys
import typing
from pathlib import Path

from addnorm import __version__

DEFAULT_ARTIFACT = Path("artifacts/default")
# Old spellings a user may still type, answered with the new one instead of a bare "unrecognized arguments".
RENAMED = {"--out": "--artifact", "--model-dir": "--artifact"}


def readable(value: object) -> str:
    """A default as a user reads it: ``on``/``off``, ``none`` for an empty list, words joined, never Python's repr."""
    if value is None or value == () or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(readable, value))
    return str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, readable, unless it has none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))  # by identity: 0 == False
        if "default" in text or unset or not action.option_strings:
            return text
        shown = readable(action.default).replace("%", "%%")  # help strings are %-formatted
        return f"{text} (default {shown})"


class Parser(argparse.ArgumentParser):
    """An ``argparse`` parser with ``--version``, help that shows every default readably (HelpFormatter), and
    one-line usage errors."""

    def __init__(self, *args, renamed: dict[str, str] | None = None, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.renamed = {**RENAMED, **(renamed or {})}
        add_version(self)

    def error(self, message: str) -> typing.NoReturn:
        hints = [
            f"{old} is now {new}"
            for old, new in self.renamed.items()
            if re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", message)
        ]
        hint = f" ({'; '.join(hints)})" if hints else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (see --help)\n")


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the command's name and the installed version."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def add_artifact(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str) -> None:
    """``--artifact DIR``: the artifact directory a command writes or reads (default artifacts/default)."""
    parser.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, metavar="DIR", help=help)


def add_providers(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--providers``: where onnxruntime runs (model.runtime: PROVIDERS, resolve_providers)."""
    from addnorm.model.runtime import SETTINGS

    parser.add_argument(
        "--providers",
        choices=SETTINGS,
        default="auto",
        help=providers_help(),
    )


def providers_help() -> str:
    """``--providers``' help, from model.runtime's table (addnorm-serve's setting says the same)."""
    from addnorm.model.runtime import PROVIDERS

    named = ", ".join(p.setting for p in PROVIDERS)
    first = " or ".join(p.setting.upper() for p in PROVIDERS[:-1])
    return (
        f"onnxruntime's execution provider: auto ({first} when onnxruntime offers it, else CPU), or one of {named} "
        "(an error when absent: never a silent fall back to CPU)"
    )


def add_output(parser: argparse.ArgumentParser) -> None:
    """How much a command prints: a summary by default, ``-v`` everything, ``-q`` errors only, ``--json`` the
    full parity report as JSON on stdout (nothing else there)."""
    parser.add_argument("--json", action="store_true", help="print the full parity report as JSON on stdout")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    loud.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the parity table (a line per case and output)",
    )


def quiet_dependencies() -> None:
    """No progress bars or advisory warnings from Hugging Face libraries: a command prints its own lines only."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "transformers" in sys.modules:  # imported before the command ran (in a test, say): its switches now
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def _launch(module: str) -> int:
    """A console script: ``--version`` answered before the command's module is imported (it may need an extra this
    install lacks: addnorm-export without torch still tells its version), then the module's ``main``."""
    if sys.argv[1:] == ["--version"]:
        print(f"{os.path.basename(sys.argv[0])} {__version__}")
        return 0
    import importlib

    return importlib.import_module(module).main()


def export_main() -> int:
    return _launch("addnorm.export.cli")


def parity_main() -> int:
    return _launch("addnorm.export.parity_cli")


def serve_main() -> int:
    return _launch("addnorm.service.cli")


def triton_main() -> int:
    return _launch("addnorm.service.protocols.v2.triton_repo")
