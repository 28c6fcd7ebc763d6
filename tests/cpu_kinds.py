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

import numpy as np

from addnorm.model.runtime import cpu_flags
from bench.server import ROOT

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
    from addnorm.model.golden import load_golden
    from addnorm.service.backend.engine import Engine
    from addnorm.service.backend.engine import verify_engine
    directory, out = sys.argv[1], sys.argv[2]
    engine = Engine(directory, providers="cpu")
    v = verify_engine(engine, "strict")
    golden = load_golden(directory + "/golden.safetensors")
    np.savez(out, **{k: engine.run(c["embeddings"], c["mask"])["encoded"] for k, c in golden.items()})
    print(json.dumps({"status": v.status, "message": v.message, "max_abs_err": v.max_abs_err}))
    """
)


PAIRS_K = 64  # the probe's products: 255 x 127 each
SATURATED, EXACT = 32767 * PAIRS_K // 2, 255 * 127 * PAIRS_K  # every u8 x s8 pair saturated in int16; exact


def saturation_probe(path: Path) -> Path:
    """A MatMulInteger summing 255 x 127 over PAIRS_K products, written to ``path``: onnxruntime answers EXACT with
    VNNI and SATURATED on AVX2's VPMADDUBSW (pairs summed in int16): which kernels its MLAS picked."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, PAIRS_K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((PAIRS_K, 1), 127, np.int8), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


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
