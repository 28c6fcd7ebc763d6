"""Optional extras: a command whose extra is not installed says so in one line instead of a traceback."""

from __future__ import annotations

import importlib


def require(extra: str, command: str, *modules: str) -> None:
    """Exit with one line naming the extra when any of ``modules`` cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise SystemExit(
                f"error: {command} needs the '{extra}' extra ({name} is not installed): "
                f"pip install 'addnorm[{extra}]'"
            ) from None
