"""Golden data: fixed inputs with their float64-oracle and torch fp32 outputs, stored in the artifact
(``golden.safetensors``, no pickle), and the check a server runs on them at load, on its own session and provider.
Torch-free: the service reads and checks it; export writes it (export.golden).

Layout: for each case ``C``, the arrays ``C/embeddings`` (B, S, E) float32, ``C/mask`` (B, S) bool, and for every
output ``O`` of the contract (model.contract.OUTPUT_NAMES) ``C/oracle.O`` float64 and ``C/torch.O`` float32; since
the gate keeps them (its own cases, its own rule), ``C/spread.O`` (float32's spread on the case, or a lossy scheme's: a scalar),
``C/scheme.O`` (a lossy variant's scheme, float64) and ``C/representative`` (whether its quality is judged).
Everything is batch-first, as the service speaks. Files written before outputs were named hold ``C/oracle`` and
``C/torch``: they read as ``oracle.encoded`` and ``torch.encoded``.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as load_bytes
from safetensors.numpy import load_file, save_file

from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, positional
from addnorm.model.verdict import Tolerance, compare

FIELDS = (EMBEDDINGS, MASK)
REPRESENTATIVE = "representative"
_BEFORE_NAMES = {"oracle": f"oracle.{ENCODED}", "torch": f"torch.{ENCODED}"}  # the layout's first version


def save_golden(path: str | Path, cases: dict[str, dict[str, np.ndarray]]) -> None:
    save_file(
        {f"{case}/{k}": np.ascontiguousarray(v) for case, arrays in cases.items() for k, v in arrays.items()},
        str(path),
    )


def load_golden(source: str | Path | bytes) -> dict[str, dict[str, np.ndarray]]:
    """The golden cases of a file, or of its bytes as read and verified (model.artifact.read_verified)."""
    cases: dict[str, dict[str, np.ndarray]] = {}
    arrays = load_bytes(source) if isinstance(source, bytes) else load_file(str(source))
    for key, value in arrays.items():
        case, _, field = key.rpartition("/")
        cases.setdefault(case, {})[_BEFORE_NAMES.get(field, field)] = value
    for case, arrays in cases.items():
        missing = [f for f in FIELDS if f not in arrays]
        missing += [f"torch.{name}" for name in outputs(arrays) if f"torch.{name}" not in arrays]
        if missing or not outputs(arrays):
            raise ValueError(f"golden case {case!r} lacks {missing or ['any output']}")
    return cases


def representative(case: dict[str, np.ndarray]) -> bool:
    """Whether a lossy variant's quality is judged on this golden case (files before the flag: every case)."""
    return bool(np.all(case.get(REPRESENTATIVE, True)))


def outputs(case: dict[str, np.ndarray]) -> list[str]:
    """The outputs a golden case holds, by name."""
    return sorted(field.partition(".")[2] for field in case if field.startswith("oracle."))


@dataclass(frozen=True)
class Verification:
    """What the load-time check found: ``status`` passed | failed | skipped (off) | unverifiable (no golden data)."""

    status: str
    provider: str
    message: str
    max_abs_err: float | None = None  # against torch fp32, over every golden case
    max_onnx_vs_f64: float | None = None
    tolerance: dict | None = None
    worst_case: str | None = None
    cases: int = 0
    seconds: float = 0.0
    at: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


def verify(
    run: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
    golden: dict[str, dict[str, np.ndarray]],
    tol: Tolerance,
    provider: str,
) -> Verification:
    """Run every golden case through ``run`` (embeddings, mask -> outputs by name) and judge every output it holds
    as the export gate does."""
    start = time.perf_counter()
    worst_case, worst_abs, worst_f64, failed = "", 0.0, 0.0, []
    for case, c in golden.items():
        got = run(c[EMBEDDINGS], c[MASK])
        for name in outputs(c):
            spread = c.get(f"spread.{name}")
            result = compare(
                name,
                got[name],
                c[f"torch.{name}"],
                c[f"oracle.{name}"],
                tol,
                scheme=c.get(f"scheme.{name}"),
                spread=float(np.max(spread)) if spread is not None else None,
                quality=representative(c),
                real=~c[MASK] if positional(name) else None,
            )
            if result.max_abs >= worst_abs:
                worst_case, worst_abs = case, result.max_abs
            worst_f64 = max(worst_f64, result.onnx_vs_f64)
            if not result.passed:
                failed.append(
                    f"case {case!r}, output {name}: max abs err {result.max_abs:.3e} vs torch at "
                    f"{result.worst_index}, worst row relative RMS {result.row_rel_rms:.3e}, "
                    f"{result.onnx_vs_f64:.3e} vs float64 (float32's spread {result.spread:.3e}, floor "
                    f"{result.float32_floor:.3e})"
                    + (
                        f", graph vs its scheme {result.graph_vs_scheme:.3e} (the scheme vs fp32 "
                        f"{result.scheme_vs_fp32:.3e})"
                        if result.graph_vs_scheme is not None
                        else ""
                    )
                    + f"; rule {tol.describe()}"
                )
    status = "failed" if failed else "passed"
    message = "; ".join(failed) if failed else f"{len(golden)} golden cases within tolerance on {provider}"
    return Verification(
        status=status,
        provider=provider,
        message=message,
        max_abs_err=worst_abs,
        max_onnx_vs_f64=worst_f64,
        tolerance=asdict(tol),
        worst_case=worst_case,
        cases=len(golden),
        seconds=round(time.perf_counter() - start, 4),
        at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )
