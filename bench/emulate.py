"""Run a command as if on a smaller x86 CPU: what an AVX2-only machine (or one without AMX) gets, measured here.

    python -m bench.emulate avx2 -- python -m bench.studies.int8_kernels
    python -m bench.emulate avx512 -- python -m bench --real
    python -m bench.emulate avx2 -- make test

``avx2`` hides AVX-512 (every subset), AVX-VNNI and AMX: the kernels onnxruntime's MLAS, torch, numpy, OpenBLAS and
model/kernels pick are those of an AVX2 and FMA CPU. ``avx512`` hides AMX only: an AVX-512 VNNI CPU (an AMD EPYC of
the Zen 4 kind, an Intel before Sapphire Rapids). bench/emulate_cpu.c (built here once per source, preloaded)
does it with Linux's CPUID faulting: every CPUID the programs execute answers without those features, and
/proc/cpuinfo reads without their flags. It needs a CPU and kernel with CPUID faulting (``cpuid_fault`` in
/proc/cpuinfo: Intel CPUs, Linux >= 4.12; virtual machines pass it through on KVM); it says so where there is none.

The instructions the emulated CPU runs are this CPU's: its speed is this core's at AVX2, not another machine's. Ratios
measured side by side under it (graphs taking turns, as bench.studies.int8_kernels does) are what it is for.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from addnorm.commands import Parser

SOURCE = Path(__file__).with_name("emulate_cpu.c")
CACHE = Path.home() / ".cache" / "addnorm"
KINDS = {
    "avx2": "AVX2 and FMA: no AVX-512, AVX-VNNI or AMX",
    "avx512": "AVX-512 with VNNI, no AMX",
}


class EmulationError(RuntimeError):
    """This machine cannot emulate a smaller CPU; the message says why."""


def can_fault_cpuid(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "cpuid_fault" in line.split() for line in f)
    except OSError:
        return False


def shim() -> Path:
    """bench/emulate_cpu.c built (once per source digest) into ~/.cache/addnorm."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = CACHE / f"emulate_cpu-{digest}.so"
    if out.is_file():
        return out
    compiler = os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise EmulationError(f"no C compiler ({compiler}) to build {SOURCE.name} with; install gcc or set CC")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        done = subprocess.run(
            [compiler, "-O2", "-fPIC", "-shared", str(SOURCE), "-o", str(part), "-ldl"],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise EmulationError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr[-4000:]}")
        part.replace(out)
    return out


def environment(kind: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (os.environ) with the shim preloaded for ``kind`` (inside an avx2 emulation, avx2 whatever
    ``kind``: a smaller CPU does not grow); glibc told to pick its string functions alike."""
    if kind not in KINDS:
        raise EmulationError(f"unknown CPU kind {kind!r}; one of {', '.join(KINDS)}")
    if not can_fault_cpuid():
        raise EmulationError(
            "this CPU cannot fault CPUID (no cpuid_fault in /proc/cpuinfo: an Intel CPU and Linux >= 4.12 can), "
            "so a smaller CPU cannot be emulated here"
        )
    env = dict(os.environ if base is None else base)
    if env.get("ADDNORM_EMULATE") == "avx2":  # already the smaller CPU: a nested emulation does not widen it
        kind = "avx2"
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{shim()} {preload}".strip()
    env["ADDNORM_EMULATE"] = kind
    if kind == "avx2":
        hidden = ",".join(f"-{f}" for f in ("AVX512F", "AVX512CD", "AVX512BW", "AVX512DQ", "AVX512VL"))
        env["GLIBC_TUNABLES"] = ":".join(
            filter(None, [env.get("GLIBC_TUNABLES"), f"glibc.cpu.hwcaps={hidden}"])
        )
    return env


def described_cpu() -> str:
    """This CPU's flags as /proc/cpuinfo names them, and the emulation a command runs under, if any: what a study
    prints beside its figures."""
    from addnorm.model.runtime import cpu_flags

    kind = os.environ.get("ADDNORM_EMULATE")
    return f"CPU flags {' '.join(sorted(cpu_flags()))}" + (
        f" (emulated: python -m bench.emulate {kind})" if kind else ""
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m bench.emulate",
        description=__doc__.split("\n\n")[0],
        epilog="kinds: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()),
    )
    p.add_argument("kind", choices=sorted(KINDS), help="the CPU to emulate")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run, after --")
    try:
        env = environment(args.kind)
    except EmulationError as exc:
        p.error(str(exc))
    kind = env["ADDNORM_EMULATE"]
    print(f"emulating {kind} ({KINDS[kind]}) for: {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        p.error(f"cannot run {command[0]}: {exc}")
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
