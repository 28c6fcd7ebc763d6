"""Optional extras: a command whose extra is not installed says so in one line instead of a traceback."""

from __future__ import annotations

import importlib

# addnorm is installed from its checkout (it is on no package index); torch from the CPU index unless a GPU build
# is wanted (an unpinned torch pulls a multi-GB CUDA build).
HINTS = {
    "export": " --extra-index-url https://download.pytorch.org/whl/cpu (the CPU build of torch), or make serve"
}


def require(extra: str, command: str, *modules: str) -> None:
    """Exit with one line naming the extra when any of ``modules`` cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise SystemExit(
                f"error: {command} needs the '{extra}' extra ({name} is not installed): from the addnorm "
                f"checkout, pip install '.[{extra}]'{HINTS.get(extra, '')}"
            ) from None
