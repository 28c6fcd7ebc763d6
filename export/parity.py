"""Parity of an ONNX graph against the torch module it came from, judged with a float64 oracle.

For every case the same weights run three ways: torch float32 (the reference users compare against),
onnxruntime (the graph under test) and torch float64 (the oracle). A case passes when onnxruntime meets the
fp32 tolerance against torch, or, for inputs on which float32 itself is inexact, when its error against the
oracle is no worse than float32's spread on that input (the largest error vs float64 of torch, the numpy float32
reference and torch on the input moved by one ulp) or a float32 floor, times ORACLE_FACTOR (model.verdict).
A lossy variant is judged on its implementation (against its scheme) and, on representative inputs, its quality.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from addnorm.export import traces
from addnorm.export.cases import Case, Given, default_cases
from addnorm.export.yardsticks import (  # noqa: F401  torch_outputs and float32_yardstick: export.parity's API too
    SchemeModel,
    float32_spread,
    float32_yardstick,
    scheme_spread,
    teacher_forced,
    torch_outputs,
)
from addnorm.model import kernels, packing, reference
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, OUTPUT_NAMES, SCORES, output_names, positional
from addnorm.model.encoder import Encoder
from addnorm.model.golden import REPRESENTATIVE
from addnorm.model.runtime import CPU, CUDA, session_args
from addnorm.model.verdict import Comparison, Tolerance, compare

# Two float64 computations of one block differ by rounding (~1e-14 here); far above that, one of them is wrong.
ORACLES_AGREE = 1e-9
GRAPH_OPT_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass
class CaseResult:
    case: str
    shape: list[int]
    masked_positions: int
    comparisons: list[Comparison]
    condition: float = 0.0
    oracles_gap: float = 0.0  # max |numpy float64 reference - torch float64| over the served outputs
    representative: bool = True  # a lossy variant's quality was judged on it

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons) and self.oracles_gap <= ORACLES_AGREE

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
    # what the inputs were: "synthetic" (seeded random cases only) or "given" (--calibration's, with synthetic)
    inputs: str = "synthetic"
    # case name -> its arrays, for the cases run_parity was asked to keep (the artifact's golden data)
    kept: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

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
        steps = sorted({c.output for r in self.results for c in r.comparisons} - set(OUTPUT_NAMES))
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
            "max_row_rel_rms": max(c.row_rel_rms for c in finals),
            "max_oracles_gap": max(r.oracles_gap for r in self.results),
            # the rule that decided: each case's comparisons within the tolerance of torch fp32, or passed by
            # the float64 rule only; the worst comparison's distance to its allowance (model.verdict: <= 1 passes)
            "cases_within_tolerance": sum(
                all(c.within_tolerance for c in r.comparisons) for r in self.results
            ),
            "cases_by_float64_rule": sum(
                r.passed and not all(c.within_tolerance for c in r.comparisons) for r in self.results
            ),
            "worst_ratio": max(c.ratio for r in self.results for c in r.comparisons),
            "inputs": self.inputs,
            "max_spread": max(c.spread for c in finals),
            **self._lossy_summary(),
            "worst": {
                "case": case.case,
                "output": worst.output,
                "index": worst.worst_index,
                "onnx": worst.worst_onnx,
                "torch": worst.worst_torch,
                "abs_err": worst.max_abs,
            },
            "providers": self.providers,
            "graph_optimization": self.graph_optimization,
        }

    def _lossy_summary(self) -> dict[str, Any]:
        """A lossy variant's two verdicts over every case: quality (representative cases) and implementation."""
        comps = [(r, c) for r in self.results for c in r.comparisons]
        if not any(c.implementation is not None or c.quality is not None for _, c in comps):
            return {}
        judged = [(r, c) for r, c in comps if c.quality is not None]
        impl = [c for _, c in comps if c.implementation is not None]
        return {
            "quality": {
                "passed": all(c.quality for _, c in judged) if judged else None,
                "cases": len({r.case for r, _ in judged}),
                "worst_row_rel_rms": max((c.row_rel_rms for _, c in judged), default=None),
                "least_row_cosine": min((c.row_cosine for _, c in judged), default=None),
                "least_sentence_cosine": min((c.sentence_cosine for _, c in judged), default=None),
            },
            "implementation": {
                "passed": all(c.implementation for c in impl) if impl else None,
                "comparisons": len(impl),
                "worst_graph_vs_scheme": max((c.graph_vs_scheme for c in impl), default=None),
                "worst_scheme_vs_fp32": max((c.scheme_vs_fp32 for c in impl), default=None),
            },
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "cases": [
                {
                    "case": r.case,
                    "shape": r.shape,
                    "masked_positions": r.masked_positions,
                    "passed": r.passed,
                    "representative": r.representative,
                    "condition": r.condition,
                    "outputs": [asdict(c) for c in r.comparisons],
                }
                for r in self.results
            ],
        }


SEED = 1234  # the random inputs' seed: the export's gate and addnorm-parity's default draw the same cases


def make_session(
    model_path: str | Path, graph_optimization: str = "all", providers: list[str] | None = None
) -> ort.InferenceSession:
    """A session on ``providers`` (CPU by default). Asking for CUDA and not getting it is an error, never a
    silent run on CPU. A packed graph's session takes padded feeds like any other (model.packing.PaddedFeeds)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = GRAPH_OPT_LEVELS[graph_optimization]
    opts.log_severity_level = 3
    # A check's runs are few and far between (numpy's comparisons in between): threads spinning between them only
    # burn the cores. Without, all-MiniLM-L6-v2's export takes 0.90x the CPU and 0.95x the time, six tiny BERT
    # exports 0.85-0.89x the CPU (docs/benchmarks.md, "Checks' sessions asleep"); the answers do not depend on it.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    wanted = providers or [CPU]
    if CUDA in wanted and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA and cuDNN from their pip packages, when installed that way
    # int8's kernels where the server on this machine would run them (its ADDNORM_KERNELS setting)
    kernels.register(opts, wanted[0], os.environ.get(kernels.ENV, "auto"))
    session = ort.InferenceSession(
        str(model_path),
        opts,
        **session_args(wanted),
    )
    if session.get_providers()[0] != wanted[0]:
        raise RuntimeError(f"{wanted[0]} is not usable here: the session runs on {session.get_providers()}")
    return packing.PaddedFeeds(session) if packing.is_packed(session) else session


def run_parity(
    encoder: Encoder,
    session: ort.InferenceSession,
    cases: list[Case] | None = None,
    tol: Tolerance | None = None,
    seed: int = SEED,
    graph_optimization: str = "all",
    debug_session: ort.InferenceSession | None = None,
    variant: str = "fp32",
    scheme: Callable[[Encoder, np.ndarray, np.ndarray, bool], dict[str, np.ndarray]] | None = None,
    keep: frozenset[str] = frozenset(),
    scheme_ulp: type = np.float32,
    scheme_model: SchemeModel | None = None,
) -> ParityReport:
    """Run every case through torch fp32, onnxruntime and torch float64, and compare under ``tol`` (the
    variant's, from export.variants; fp32's by default). The numpy float64 reference (model/reference.py) runs
    each case too: a gap to torch's float64 above ORACLES_AGREE fails the case (an oracle is wrong). The gate (export.gate) is what callers normally use.

    ``debug_session`` runs a debug graph of the same variant that also outputs every Add & Norm result; each
    step is then compared with torch's, so a drift names its sublayer. ``scheme`` (a lossy variant's, from
    export.variants) computes that variant's own arithmetic in torch: the graph's implementation is judged
    against it, and where one evaluation of it does not pass, also its evaluation on the input moved by one ulp
    of ``scheme_ulp`` (the precision the scheme rounds its input to: ``scheme_spread``). ``scheme_model``: the
    scheme as a module; with it a lossy graph's steps are judged step by step (export.yardsticks.teacher_forced).
    ``keep``: names of cases whose inputs and reference outputs the report keeps (``report.kept``: the artifact's
    golden data, so the server's check at load applies this rule to these very cases).
    """
    tol = tol or Tolerance()
    cases = cases if cases is not None else default_cases()
    cfg = encoder.config
    encoder = encoder.eval().float()
    oracle = copy.deepcopy(encoder).double()
    # The second float64 oracle, sharing no code with torch (model/reference.py): the two must agree.
    weights64 = {k: v.detach().numpy() for k, v in oracle.state_dict().items()}
    weights32 = {k: v.detach().numpy() for k, v in encoder.state_dict().items()}
    with_steps = debug_session is not None
    model_key = traces.key(encoder)[0] if traces.cache() is not None else None
    # The debug graph's extra outputs, after the served ones (model.contract.output_names).
    served = list(output_names(cfg))
    step_names = [o.name for o in debug_session.get_outputs()][len(served) :] if with_steps else []
    rng = np.random.default_rng(seed)  # the inputs
    sample_rng = np.random.default_rng(seed + 1)  # error samples for plots: never shifts the inputs
    report = ParityReport(
        tol, providers=session.get_providers(), graph_optimization=graph_optimization, variant=variant
    )
    report.inputs = "given" if any(isinstance(c, Given) for c in cases) else "synthetic"
    for index, case in enumerate(cases):
        x, mask = case.make(cfg.d_model, rng)  # (B, S, E)
        condition = case.condition(x)
        if not cfg.batch_first:
            x = np.ascontiguousarray(x.transpose(1, 0, 2))  # (S, B, E)
        feed = {EMBEDDINGS: x, MASK: mask}
        # what torch and numpy compute from the module and this input alone: once per scope (export/traces.py)
        given = (model_key, traces.digest(x, mask), with_steps) if model_key else None
        torch_outs = _once(given, "torch", torch_outputs, encoder, x, mask, with_steps)
        oracle_outs = _once(given, "oracle", torch_outputs, oracle, x.astype(np.float64), mask, with_steps)
        # a lossy graph's steps are judged on its own previous step (below): its scheme runs end to end without them
        forcing = tol.lossy and scheme_model is not None and with_steps
        scheme_outs = scheme(encoder, x, mask, with_steps and not forcing) if scheme is not None else {}
        numpy_f64 = _once(given, "numpy64", reference.outputs, cfg, weights64, x.astype(np.float64), mask)
        names = [*served, *step_names]
        onnx_outs = dict(zip(served, session.run(served, feed), strict=True))
        if debug_session is not None:
            onnx_outs.update(zip(step_names, debug_session.run(step_names, feed), strict=True))
        # a lossy graph's steps: its scheme and fp32 on the graph's own previous step (the rest: end to end), the
        # scheme's distance at least its precision's rounding of the step (a 1e4-scale residual stream in fp16)
        forced: tuple[dict, dict] = ({}, {})
        roundoff = float(np.finfo(scheme_ulp).eps) / 2
        if forcing:
            forced = teacher_forced(scheme_model, encoder, x, mask, [onnx_outs[n] for n in step_names])

        # A spread costs runs (float32's two, a lossy scheme's one): measured where one sample does not pass the
        # case, and on every case kept as golden data (the server's check judges it on another machine)
        spread: dict[str, float] = {}
        for measured in (False, True):
            comparisons = [
                compare(
                    name,
                    np.asarray(onnx_outs[name]),
                    torch_outs[name],
                    oracle_outs[name],
                    tol,
                    forced[0].get(name, scheme_outs.get(name)),
                    roundoff if name in forced[0] else spread.get(name),
                    # a head's scores are a few logits a row, whose own relative error says nothing near 0: their
                    # quality is the encoded first token's (the head runs in float in every scheme), and on real
                    # text their ranking against transformers' (hf.ids_check); the graph is held to its scheme
                    quality=case.representative and name != SCORES,
                    real=_real(cfg, name, mask, served),
                    sequence_axis=0 if not cfg.batch_first and name in served else 1,
                    scheme_ref=forced[1].get(name),
                )
                for name in names
            ]
            settled = all(c.implementation is not False if tol.lossy else c.passed for c in comparisons)
            if measured or (case.name not in keep and settled) or (tol.lossy and scheme is None):
                break
            ulps = np.random.default_rng([seed, 2, index])  # this case's one-ulp moves, whatever ran before
            if tol.lossy:
                real = {name: _real(cfg, name, mask, served) for name in names}
                spread = scheme_spread(
                    scheme, encoder, x, mask, torch_outs, real, with_steps and not forcing, ulps, scheme_ulp
                )
            else:
                spread = _once(
                    given and (*given, seed, index),  # the one-ulp moves: this case's
                    "float32 spread",
                    float32_spread,
                    *(encoder, weights32, x, mask, oracle_outs, with_steps, ulps),
                )
        for c in comparisons:
            report.samples.setdefault(c.output, []).append(
                _sample(np.asarray(onnx_outs[c.output]), torch_outs[c.output], sample_rng)
            )
        gap = max(float(np.abs(numpy_f64[name] - oracle_outs[name]).max()) for name in served)
        report.results.append(
            CaseResult(
                case.name,
                list(x.shape),
                int(mask.sum()),
                comparisons,
                condition,
                oracles_gap=gap,
                representative=case.representative,
            )
        )
        if case.name in keep:
            report.kept[case.name] = _golden_arrays(
                cfg, x, mask, torch_outs, oracle_outs, scheme_outs, spread, case.representative
            )
    return report


def _once(given: tuple | None, kind: str, fn: Callable[..., dict], *args: Any) -> dict:
    """``fn(*args)``, remembered in the open scope by ``kind`` and ``given`` (model, input, steps), or computed
    when ``given`` is None (no scope)."""
    return fn(*args) if given is None else traces.remembered((kind, *given), lambda: fn(*args))


def _real(cfg, name: str, mask: np.ndarray, served: list[str]) -> np.ndarray | None:
    """Which rows of an output hold real tokens: the positions of a positional one in its layout (a served output
    of a --no-batch-first graph is (S, B, E); the steps are (B, S, E)), None (every row) for a pooled one."""
    if not positional(name):
        return None
    return ~mask if cfg.batch_first or name not in served else ~mask.T


def _golden_arrays(cfg, x, mask, torch_outs, oracle_outs, scheme_outs, spread, representative) -> dict:
    """One case as model.golden stores it: batch-first, every served output's torch fp32 and float64 results,
    float32's spread on it, a lossy variant's scheme, and whether its quality is judged."""

    def batch_first(a: np.ndarray, name: str = ENCODED) -> np.ndarray:
        return a if cfg.batch_first or not positional(name) else np.ascontiguousarray(a.swapaxes(0, 1))

    arrays = {EMBEDDINGS: batch_first(x), MASK: mask}
    for name in output_names(cfg):
        arrays[f"torch.{name}"] = batch_first(torch_outs[name], name).astype(np.float32)
        arrays[f"oracle.{name}"] = batch_first(oracle_outs[name], name).astype(np.float64)
        if name in spread:
            arrays[f"spread.{name}"] = np.asarray([spread[name]], np.float64)
        if name in scheme_outs:
            arrays[f"scheme.{name}"] = batch_first(scheme_outs[name], name).astype(np.float64)
    arrays[REPRESENTATIVE] = np.asarray([representative])
    return arrays


def _sample(out: np.ndarray, ref: np.ndarray, rng: np.random.Generator, n: int = 4096) -> np.ndarray:
    diff = np.abs(out.astype(np.float64) - ref).ravel()
    return diff if diff.size <= n else rng.choice(diff, n, replace=False)
