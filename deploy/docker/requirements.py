"""Print the requirements pyproject.toml declares, for the Dockerfile's dependency layer.

``python requirements.py [--extra NAME ...] [--drop NAME ...]``: the base dependencies and each extra's, one per
line, without those whose distribution is dropped (``--drop onnxruntime`` for the GPU image, whose
``onnxruntime-gpu`` provides the same module). The image installs these before it copies the source, so an
edit to the code reuses the dependency layers, then installs addnorm itself with ``--no-deps``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str], drop: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"error: no extra {unknown} in {pyproject}; it has {sorted(optional)}")
    wanted = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    name = re.compile(r"^\s*([A-Za-z0-9._-]+)")
    out: list[str] = []
    for req in wanted:
        dist = name.match(req)[1].lower()
        if dist not in drop and req not in out:
            out.append(req)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    p.add_argument("--extra", action="append", default=[], help="an extra of the project (repeatable)")
    p.add_argument("--drop", action="append", default=[], help="a distribution to leave out (repeatable)")
    args = p.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.extra, [d.lower() for d in args.drop])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
