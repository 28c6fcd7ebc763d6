"""One-off investigations, each with its finding in README.md beside it; the benchmarks a user runs are bench/."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


def checkout_arguments(p) -> None:
    """The positional checkouts a study compares side by side (``checkouts_of`` reads them)."""
    p.add_argument("checkouts", nargs="*", type=Path, help="checkouts to compare (default: this one)")


def checkouts_of(p, args) -> list[Path]:
    """``checkout_arguments``' checkouts, resolved (this one when none is given); each must be one of addnorm (an
    older commit: ``git worktree add /tmp/before REV``), else the parser's error."""
    from bench.server import ROOT

    checkouts = [c.resolve() for c in args.checkouts] or [ROOT]
    for c in checkouts:
        if not (c / "service" / "cli.py").is_file():
            p.error(f"{c} is not a checkout of addnorm (no service/cli.py)")
    return checkouts


def text_arguments(p) -> None:
    """The text studies' ``--artifact`` and ``--sentences`` (``text_inputs`` reads them)."""
    p.add_argument(
        "--artifact",
        type=Path,
        help="an ids artifact (default: all-MiniLM-L6-v2 exported here, as bench --text does)",
    )
    p.add_argument("--sentences", type=int, default=0, help="the first N of bench.text's sentences (0: all)")


@contextlib.contextmanager
def text_inputs(args) -> Iterator[tuple[Path, str, list[str]]]:
    """(the artifact, its model's name, the sentences) of ``text_arguments``: all-MiniLM-L6-v2 exported into a
    temporary directory, kept while the block runs, when no ``--artifact`` is given."""
    from addnorm.model.artifact import Manifest
    from bench.text import export_minilm, sentences

    texts = sentences()[: args.sentences or None]
    if args.artifact:
        yield args.artifact, Manifest.load(args.artifact).name, texts
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield export_minilm(Path(tmp) / "minilm"), "all-MiniLM-L6-v2", texts
