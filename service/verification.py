"""Parity where it is served: at load, the artifact's golden inputs run through this server's own session, on the
provider it serves with, judged by the export gate's rule (model.verdict) under the variant's tolerance.

The sha256 proves the file is the one exported; this proves the runtime here computes what was checked there
(another onnxruntime build, another CPU, the CUDA provider's kernels).
"""

from __future__ import annotations

import dataclasses

from model.golden import Verification, load_golden, verify
from model.runtime import CPU, VNNI_FLAGS, cpu_flags
from model.verdict import Tolerance
from service.engine import Engine


def verify_engine(engine: Engine, mode: str) -> Verification:
    """``mode`` strict or warn: run the check (the caller decides what a failure means); off: skip it."""
    provider = engine.providers[0]
    if mode == "off":
        return Verification("skipped", provider, "verification at load is off (ADDNORM_VERIFY_ON_LOAD=off)")
    if not engine.manifest.golden_sha256:
        return Verification(
            "unverifiable",
            provider,
            "the artifact has no golden data (exported before addnorm stored it); re-export it to verify at load",
        )
    golden = load_golden(engine.golden)  # the bytes whose sha256 the engine checked, read once
    tol = Tolerance(**engine.manifest.parity["tolerance"])
    result = verify(engine.run, golden, tol, provider)
    if result.status == "failed" and engine.manifest.variant == "int8" and provider == CPU:
        result = dataclasses.replace(result, message=result.message + int8_cpu_hint(cpu_flags()))
    return result


def int8_cpu_hint(flags: frozenset[str]) -> str:
    """Why an int8 graph can fail on this CPU kind ("" where it has VNNI): appended to a failed check's message."""
    if flags & VNNI_FLAGS:
        return ""
    return (
        f"; this CPU has no VNNI ({', '.join(sorted(flags)) or 'no AVX2'}), where onnxruntime's u8 x s8 "
        "kernels add pairs of products in int16 and saturate on 8-bit weights: re-export it with this "
        "addnorm (addnorm-export --variant int8 writes 7-bit weights, exact on every CPU kind)"
    )
