"""Running code on an emulated AVX2-only CPU (QEMU user mode, ``Haswell-v4``: AVX2 and FMA, no AVX-512, no VNNI),
and the server's golden check there, torch-free. Shared by tests/export/test_cpu_kinds.py and test_matrix.py."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from bench.server import ROOT
from model.runtime import cpu_flags

QEMU = shutil.which("qemu-x86_64")
AVX2_ONLY = "Haswell-v4"  # AVX2 and FMA; no AVX-512, no VNNI
CAN_EMULATE = QEMU is not None and platform.machine() == "x86_64"

# This machine is itself the AVX2-only kind (AVX2, no AVX-512): what runs here natively is what the emulation shows
HOST_IS_AVX2_ONLY = "avx2" in cpu_flags() and "avx512f" not in cpu_flags()
WHY_NOT = "needs qemu-x86_64 (Debian's qemu-user; .ci/run installs it) on an x86-64 host"

# The golden check as the server runs it at load, torch-free; prints its verdict and where it wrote the answers.
CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from model.golden import load_golden
    from service.engine import Engine
    from service.engine import verify_engine
    directory, out = sys.argv[1], sys.argv[2]
    engine = Engine(directory, providers="cpu")
    v = verify_engine(engine, "strict")
    golden = load_golden(directory + "/golden.safetensors")
    np.savez(out, **{k: engine.run(c["embeddings"], c["mask"])["encoded"] for k, c in golden.items()})
    print(json.dumps({"status": v.status, "message": v.message, "max_abs_err": v.max_abs_err}))
    """
)


def run(args: list[str], cwd: Path = ROOT) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def emulated(*args: str) -> list[str]:
    assert QEMU is not None, WHY_NOT
    return [QEMU, "-cpu", AVX2_ONLY, sys.executable, *args]


def golden_check(directory: Path, out: Path, emulate: bool) -> dict:
    args = ["-c", CHECK, str(directory), str(out)]
    return json.loads(run(emulated(*args) if emulate else [sys.executable, *args]).splitlines()[-1])
