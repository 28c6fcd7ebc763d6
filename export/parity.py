"""Parity of an ONNX graph against the torch module it came from, judged with a float64 oracle.

For every case the same weights run three ways: torch float32 (the reference users compare against),
onnxruntime (the graph under test) and torch float64 (the oracle). A case passes when onnxruntime meets the
fp32 tolerance against torch, or, for inputs on which float32 itself is inexact, when its error against the
oracle is no worse than torch's own error against the oracle times ORACLE_FACTOR.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from export.onnx_export import OUTPUT_NAME
from model.encoder import Encoder

FP32_ATOL = 1e-5
FP32_RTOL = 1e-4
ORACLE_FACTOR = 4.0  # ONNX may be this many times further from float64 than torch fp32 is (and still pass)

GRAPH_OPT_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True)
class Tolerance:
    """Element-wise ``|onnx - torch| <= atol + rtol * |torch|``; ``rel_rms`` also bounds the relative RMS error
    ``||onnx - torch|| / ||torch||`` of each output.

    ``oracle_factor`` 0 turns the float64 rescue off (lossy variants are judged against torch fp32 only).
    """

    atol: float = FP32_ATOL
    rtol: float = FP32_RTOL
    oracle_factor: float = ORACLE_FACTOR
    rel_rms: float | None = None


# Each variant's gate, against torch fp32 on the same weights (docs/parity.md has the measured errors).
# fp16 computes in half precision with LayerNorm statistics in float32 (stash_type 1). int8 quantizes the
# weights and, per run and per tensor, the activations of every weight MatMul: on random weights its worst case
# (few tokens) reaches a relative RMS error of 0.10 at d_model 768 and 0.21 at 64, so its gate catches broken
# graphs (wrong weights give ~1.4), not the last digits.
VARIANT_TOLERANCES = {
    "fp32": Tolerance(),
    "fused": Tolerance(),
    "fp16": Tolerance(atol=2e-2, rtol=1e-2, oracle_factor=0.0),
    "int8": Tolerance(atol=1.0, rtol=0.0, oracle_factor=0.0, rel_rms=0.3),
}


@dataclass(frozen=True)
class Case:
    """One parity input: ``offset + scale * N(0, 1)`` of shape (batch, seq, d_model), optionally padded.

    ``pad`` is the fraction of each row's positions (after the first) that are padding; ``constant`` makes
    every feature of a position equal (zero variance); ``all_pad_row`` makes the first row entirely padding.
    """

    name: str
    batch: int
    seq: int
    pad: float = 0.0
    offset: float = 0.0
    scale: float = 1.0
    constant: bool = False
    all_pad_row: bool = False

    def condition(self, x: np.ndarray) -> float:
        """How hard the input is for float32 LayerNorm: the largest |mean| / std over positions."""
        mean = np.abs(x.mean(-1, dtype=np.float64))
        std = x.std(-1, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(std > 0, mean / np.maximum(std, 1e-30), np.where(mean > 0, np.inf, 0.0))
        return float(ratio.max())

    def make(self, d_model: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Returns (embeddings (B, S, E) float32, mask (B, S) bool, true = padding)."""
        shape = (self.batch, self.seq, 1 if self.constant else d_model)
        x = self.offset + self.scale * rng.standard_normal(shape)
        x = np.broadcast_to(x, (self.batch, self.seq, d_model)).astype(np.float32)
        mask = np.zeros((self.batch, self.seq), dtype=bool)
        if self.pad > 0:
            for b in range(self.batch):
                n_pad = int(rng.integers(0, round(self.pad * (self.seq - 1)) + 1))
                if n_pad:
                    mask[b, self.seq - n_pad :] = True
        if self.all_pad_row:
            mask[0, :] = True
        return np.ascontiguousarray(x), mask


def default_cases() -> list[Case]:
    """20+ random cases whose sizes differ from the export example (2, 5): seq 1, a long one, with and without masks."""
    sizes = [(1, 1), (3, 1), (1, 2), (4, 3), (3, 4), (1, 7), (2, 8), (5, 9), (1, 16), (3, 16), (8, 12), (2, 33),
             (6, 31), (4, 64), (1, 100), (2, 128), (1, 256), (3, 47), (7, 20), (1, 512)]  # fmt: skip
    cases = []
    for i, (b, s) in enumerate(sizes):
        pad = 0.5 if i % 2 and s > 1 else 0.0
        cases.append(Case(f"random b{b} s{s}{' masked' if pad else ''}", b, s, pad=pad))
    return cases


def adversarial_cases() -> list[Case]:
    """Inputs on which float32 itself is inexact or masking is extreme; each named in the report."""
    return [
        Case("offset 1e2", 2, 16, offset=1e2),
        Case("offset 1e3", 2, 16, offset=1e3),
        Case("offset 1e4, spread 0.01", 2, 16, offset=1e4, scale=0.01),
        Case("tiny spread (near eps)", 2, 16, scale=3e-3),
        Case("constant rows (variance 0)", 2, 16, offset=0.5, constant=True),
        Case("huge magnitude (1e4 scale)", 2, 16, scale=1e4),
        Case("long sequence (2048)", 1, 2048),
        Case("heavy padding (90%)", 4, 64, pad=0.9),
        Case("row all padding", 3, 16, pad=0.5, all_pad_row=True),
    ]


@dataclass
class Comparison:
    """How one output of one case compares: ONNX vs torch fp32, and both vs the float64 oracle."""

    output: str
    max_abs: float
    max_rel: float
    mean_abs: float
    p99_abs: float
    rel_rms: float
    torch_vs_f64: float
    onnx_vs_f64: float
    within_tolerance: bool
    passed: bool
    worst_index: list[int]
    worst_onnx: float
    worst_torch: float
    finite: bool


@dataclass
class CaseResult:
    case: str
    shape: list[int]
    masked_positions: int
    comparisons: list[Comparison]
    condition: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def final(self) -> Comparison:
        return self.comparisons[0]


@dataclass
class ParityReport:
    tolerance: Tolerance
    results: list[CaseResult] = field(default_factory=list)
    providers: list[str] = field(default_factory=list)
    graph_optimization: str = "all"
    variant: str = "fp32"
    # output name -> sampled |onnx - torch| errors over all cases (for the report's histograms; not in JSON)
    samples: dict[str, list[np.ndarray]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def worst(self) -> tuple[CaseResult, Comparison]:
        """The comparison furthest beyond its tolerance (or closest to it, when all pass)."""
        pairs = [(r, c) for r in self.results for c in r.comparisons]
        return max(pairs, key=lambda rc: (not rc[1].passed, rc[1].max_abs))

    def summary(self) -> dict[str, Any]:
        """The figures kept in manifest.json."""
        finals = [r.final for r in self.results]
        case, worst = self.worst()
        steps = sorted({c.output for r in self.results for c in r.comparisons} - {OUTPUT_NAME})
        per_step = {
            name: max(c.max_abs for r in self.results for c in r.comparisons if c.output == name)
            for name in steps
        }
        return {
            "passed": self.passed,
            "variant": self.variant,
            "cases": len(self.results),
            "max_abs_err_per_step": per_step,
            "tolerance": asdict(self.tolerance),
            "max_abs_err": max(c.max_abs for c in finals),
            "max_rel_err": max(c.max_rel for c in finals),
            "max_torch_vs_f64": max(c.torch_vs_f64 for c in finals),
            "max_onnx_vs_f64": max(c.onnx_vs_f64 for c in finals),
            "worst": {"case": case.case, "output": worst.output, "index": worst.worst_index,
                      "onnx": worst.worst_onnx, "torch": worst.worst_torch, "abs_err": worst.max_abs},
            "providers": self.providers,
            "graph_optimization": self.graph_optimization,
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "cases": [
                {"case": r.case, "shape": r.shape, "masked_positions": r.masked_positions, "passed": r.passed,
                 "condition": r.condition, "outputs": [asdict(c) for c in r.comparisons]}
                for r in self.results
            ],
        }  # fmt: skip

    def table(self) -> str:
        """A terminal table: one line per case and output."""
        head = f"{'case':<34} {'output':<10} {'max abs':>9} {'max rel':>9} {'torch-f64':>9} {'onnx-f64':>9}  result"
        lines = [head, "-" * len(head)]
        for r in self.results:
            for c in r.comparisons:
                verdict = "ok" if c.passed else "FAIL"
                if c.passed and not c.within_tolerance:
                    verdict = "ok (oracle)"
                lines.append(
                    f"{r.case[:34]:<34} {c.output[:10]:<10} {c.max_abs:9.2e} {c.max_rel:9.2e} "
                    f"{c.torch_vs_f64:9.2e} {c.onnx_vs_f64:9.2e}  {verdict}"
                )
        s = self.summary()
        lines.append(
            f"{'PASSED' if self.passed else 'FAILED'}: {s['cases']} cases, max abs err {s['max_abs_err']:.3e}, "
            f"max rel err {s['max_rel_err']:.3e} (atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g})"
        )
        if not self.passed:
            w = s["worst"]
            lines.append(
                f"worst element: case '{w['case']}', output {w['output']}, index {w['index']}: "
                f"onnx {w['onnx']!r} vs torch {w['torch']!r} (abs err {w['abs_err']:.3e})"
            )
        return "\n".join(lines)


def compare(
    output: str, onnx_out: np.ndarray, ref: np.ndarray, oracle: np.ndarray, tol: Tolerance
) -> Comparison:
    """Compare one output array of ONNX against torch fp32 and both against the float64 oracle."""
    onnx_out = onnx_out.astype(np.float64)
    ref = ref.astype(np.float64)
    finite = bool(np.isfinite(onnx_out).all() and np.isfinite(ref).all())
    diff = np.abs(onnx_out - ref)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only is the worst possible error
    excess = diff - (tol.atol + tol.rtol * np.abs(ref))
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    within = finite and bool((excess <= 0).all())
    ref_norm = float(np.sqrt(np.mean(ref**2)))
    rel_rms = float(np.sqrt(np.mean(diff**2)) / ref_norm) if ref_norm > 0 else float(diff.max())
    if tol.rel_rms is not None:
        within = within and rel_rms <= tol.rel_rms
    torch_f64 = _max_err(ref, oracle)
    onnx_f64 = _max_err(onnx_out, oracle)
    passed = within or (finite and onnx_f64 <= tol.oracle_factor * torch_f64)
    return Comparison(
        output=output,
        max_abs=float(diff.max()),
        max_rel=float((diff / np.maximum(np.abs(ref), tol.atol)).max()),
        mean_abs=float(diff.mean()),
        p99_abs=float(np.percentile(diff, 99, method="higher")),
        rel_rms=rel_rms,
        torch_vs_f64=torch_f64,
        onnx_vs_f64=onnx_f64,
        within_tolerance=within,
        passed=passed,
        worst_index=[int(i) for i in worst],
        worst_onnx=float(onnx_out[worst]),
        worst_torch=float(ref[worst]),
        finite=finite,
    )


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(a - b)
    return math.inf if np.isnan(d).any() else float(d.max())


def make_session(
    model_path: str | Path, graph_optimization: str = "all", providers: list[str] | None = None
) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = GRAPH_OPT_LEVELS[graph_optimization]
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model_path), opts, providers=providers or ["CPUExecutionProvider"])


def run_parity(
    encoder: Encoder,
    session: ort.InferenceSession,
    cases: list[Case] | None = None,
    tol: Tolerance | None = None,
    seed: int = 1234,
    graph_optimization: str = "all",
    debug_session: ort.InferenceSession | None = None,
    variant: str = "fp32",
) -> ParityReport:
    """Run every case through torch fp32, onnxruntime and torch float64, and compare.

    ``debug_session`` runs a debug graph of the same variant that also outputs every Add & Norm result; each
    step is then compared with torch's, so a drift names its sublayer.
    """
    tol = tol or VARIANT_TOLERANCES.get(variant, Tolerance())
    cases = cases if cases is not None else default_cases()
    cfg = encoder.config
    encoder = encoder.eval().float()
    oracle = copy.deepcopy(encoder).double()
    with_steps = debug_session is not None
    step_names = [o.name for o in debug_session.get_outputs()][1:] if with_steps else []
    rng = np.random.default_rng(seed)  # the inputs
    sample_rng = np.random.default_rng(seed + 1)  # error samples for plots: never shifts the inputs
    report = ParityReport(tol, providers=session.get_providers(), graph_optimization=graph_optimization,
                          variant=variant)  # fmt: skip
    for case in cases:
        x, mask = case.make(cfg.d_model, rng)  # (B, S, E)
        condition = case.condition(x)
        if not cfg.batch_first:
            x = np.ascontiguousarray(x.transpose(1, 0, 2))  # (S, B, E)
        feed = {"embeddings": x, "mask": mask}
        torch_outs = _torch_outputs(encoder, x, mask, with_steps)
        oracle_outs = _torch_outputs(oracle, x.astype(np.float64), mask, with_steps)
        onnx_outs = session.run([OUTPUT_NAME], feed)
        if debug_session is not None:
            onnx_outs += debug_session.run(step_names, feed)
        comparisons = []
        for i, (name, out) in enumerate(zip([OUTPUT_NAME, *step_names], onnx_outs, strict=True)):
            comparisons.append(compare(name, np.asarray(out), torch_outs[i], oracle_outs[i], tol))
            report.samples.setdefault(name, []).append(_sample(np.asarray(out), torch_outs[i], sample_rng))
        report.results.append(CaseResult(case.name, list(x.shape), int(mask.sum()), comparisons, condition))
    return report


def _sample(out: np.ndarray, ref: np.ndarray, rng: np.random.Generator, n: int = 4096) -> np.ndarray:
    diff = np.abs(out.astype(np.float64) - ref).ravel()
    return diff if diff.size <= n else rng.choice(diff, n, replace=False)


def _torch_outputs(encoder: Encoder, x: np.ndarray, mask: np.ndarray, with_steps: bool) -> list[np.ndarray]:
    steps: list[torch.Tensor] | None = [] if with_steps else None
    with torch.no_grad():
        out = encoder(torch.from_numpy(x), torch.from_numpy(mask), steps)
    return [t.numpy() for t in [out, *(steps or [])]]
