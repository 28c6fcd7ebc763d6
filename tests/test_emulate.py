"""bench/emulate.py: a smaller CPU for a process tree, at native speed (CPUID faulting), for speed ratios measured as
an AVX2-only machine or one without AMX would get them. (tests/cpu_kinds.py's QEMU emulation, slow but possible on
any x86 host, is what checks answers on the AVX2 kind.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from addnorm.model.runtime import cpu_flags
from bench import emulate
from bench.server import ROOT
from tests.cpu_kinds import EXACT, PAIRS_K, SATURATED, saturation_probe

# What the process sees: /proc/cpuinfo's flags, numpy's and the kernels' own dispatch, and onnxruntime's MLAS through
# a product whose u8 x s8 pairs saturate in int16 on AVX2 (VPMADDUBSW) and nowhere else; in a forked child too.
PROBE = f"""
import json, os, sys
import numpy as np, onnxruntime as ort
from addnorm.model import kernels
from addnorm.model.runtime import cpu_flags
if os.fork() == 0:
    os._exit(0 if "avx512f" not in open("/proc/cpuinfo").read() or os.environ.get("ADDNORM_EMULATE") != "avx2" else 1)
_, status = os.wait()
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(json.dumps({{
    "flags": sorted(cpu_flags()),
    "numpy_avx512f": bool(np._core._multiarray_umath.__cpu_features__["AVX512F"]),
    "kernels": kernels.isa(kernels.build()),
    "mlas": int(s.run(None, {{"a": np.full((1, {PAIRS_K}), 255, np.uint8)}})[0][0, 0]),
    "child": status,
}}))
"""


def _probe(tmp_path, *prefix: str) -> dict:
    saturation_probe(tmp_path / "m.onnx")
    command = [*prefix, sys.executable, "-X", "faulthandler", "-c", PROBE, str(tmp_path / "m.onnx")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not emulate.can_fault_cpuid(), reason="this CPU has no CPUID faulting (cpuid_fault)")
def test_every_library_in_the_process_tree_sees_the_smaller_cpu(tmp_path):
    """avx2: no AVX-512 for /proc/cpuinfo, numpy, model/kernels or MLAS (its pairs saturate), forks included;
    avx512: AMX hidden and AVX-512 VNNI kept. Natively the same probe sees this CPU (Python's faulthandler on
    throughout: the emulation's SIGSEGV handler stands before it)."""
    here = cpu_flags()
    native = _probe(tmp_path)
    assert native["numpy_avx512f"] == ("avx512f" in here) and native["child"] == 0
    avx2 = _probe(tmp_path, sys.executable, "-m", "bench.emulate", "avx2", "--")
    assert avx2["flags"] == ["avx2"] and not avx2["numpy_avx512f"], avx2
    assert avx2["kernels"] == "avx2" and avx2["mlas"] == SATURATED and avx2["child"] == 0, avx2
    avx512 = _probe(tmp_path, sys.executable, "-m", "bench.emulate", "avx512", "--")
    assert "amx_int8" not in avx512["flags"] and set(avx512["flags"]) == here - {"amx_int8"}, avx512
    assert avx512["kernels"] == ("vnni" if "avx512_vnni" in here else "avx2"), avx512
    assert avx512["mlas"] == (EXACT if "avx512_vnni" in here else SATURATED), avx512
    nested = emulate.environment("avx512", {"ADDNORM_EMULATE": "avx2"})  # inside avx2, avx512 stays avx2
    assert nested["ADDNORM_EMULATE"] == "avx2" and "AVX512F" in nested["GLIBC_TUNABLES"]


def test_a_machine_without_cpuid_faulting_is_told_so(tmp_path, monkeypatch, capsys):
    """No cpuid_fault: an error naming it, before anything runs; no command: a usage error."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert not emulate.can_fault_cpuid(str(cpuinfo))
    monkeypatch.setattr(emulate, "can_fault_cpuid", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        emulate.main(["avx2", "--", "true"])
    assert exit_.value.code == 2 and "cannot fault CPUID" in capsys.readouterr().err
    with pytest.raises(emulate.EmulationError, match="unknown CPU kind"):
        emulate.environment("sse2")
    with pytest.raises(SystemExit):
        emulate.main(["avx2"])
    assert "give the command to run" in capsys.readouterr().err
