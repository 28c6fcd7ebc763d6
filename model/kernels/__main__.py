"""python -m addnorm.model.kernels: build int8's kernel library (model/kernels/__init__.py) and say where it is."""

from __future__ import annotations

import sys
from pathlib import Path

from addnorm.commands import Parser
from addnorm.model.kernels import KernelError, build, cpu_lacks


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m addnorm.model.kernels", description=__doc__.split(":", 1)[1].strip())
    p.add_argument(
        "--include", type=Path, help="a directory holding onnxruntime's onnxruntime_lite_custom_op.h"
    )
    p.add_argument(
        "--build-dir",
        type=Path,
        metavar="DIR",
        help="the directory to build into (default: beside the source)",
    )
    args = p.parse_args(argv)
    try:
        path = build(args.include, args.build_dir)
    except KernelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    lacks = cpu_lacks()
    note = f" (this CPU lacks {', '.join(lacks)}: the server will not load it here)" if lacks else ""
    print(f"int8's kernels: {path}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
