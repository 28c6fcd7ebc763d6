"""How a parity report reads: the terminal summary (with every case's line when verbose), the failure message, and on disk parity.json (every figure),
parity.md (tables) and PNG plots. All formatting of parity results lives here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from addnorm.export.parity import ORACLES_AGREE, ParityReport
from addnorm.model.verdict import Comparison


def worst_message(report: ParityReport) -> str:
    """One line naming the worst element: its case, output, index, and both values."""
    w = report.summary()["worst"]
    return (
        f"worst element: case '{w['case']}', output {w['output']}, index {w['index']}: "
        f"onnx {w['onnx']!r} vs torch {w['torch']!r} (abs err {w['abs_err']:.3e})"
    )


def failure_message(report: ParityReport) -> str:
    """Why a gate failed, in one line (addnorm-export's error)."""
    s, t = report.summary(), report.tolerance
    if (
        s["max_oracles_gap"] > ORACLES_AGREE
    ):  # the graph may match torch: torch and the numpy reference disagree
        case = max(report.results, key=lambda r: r.oracles_gap)
        return (
            f"parity failed: the float64 oracles disagree (torch's module and model/reference.py differ by "
            f"{case.oracles_gap:.3e} on case '{case.case}', more than {ORACLES_AGREE:g}): one of them computes "
            "something else than the model"
        )
    if "quality" in s:
        return f"parity failed: {decided(report)} (rule {t.describe()}); " + inputs_line(report)
    return (
        f"parity failed: max abs err {s['max_abs_err']:.3e}, worst row relative RMS {s['max_row_rel_rms']:.3e} "
        f"(rule {t.describe()}); " + worst_message(report)
    )


def format_table(report: ParityReport, verbose: bool = True) -> str:
    """The verdict, its figures, the rule and the inputs; above them a line per case and output (``verbose``), or
    only the failing ones, and the worst element on failure. Names are never cut."""
    rows = [
        (r.case, c)
        for r in report.results
        for c in r.comparisons
        if verbose or not c.passed or c.quality is False or c.implementation is False
    ]
    lines = []
    if rows:
        case_w = max(len("case"), *(len(case) for case, _ in rows))
        out_w = max(len("output"), *(len(c.output) for _, c in rows))
        head = (
            f"{'case':<{case_w}} {'output':<{out_w}} {'max abs':>9} {'max rel':>9} {'f32-f64':>9} {'onnx-f64':>9}"
            "  result"
        )
        lines += [head, "-" * len(head)]
        for case, c in rows:
            lines.append(
                f"{case:<{case_w}} {c.output:<{out_w}} {c.max_abs:9.2e} {c.max_rel:9.2e} "
                f"{c.spread:9.2e} {c.onnx_vs_f64:9.2e}  {_verdict(c)}"
            )
    s, t = report.summary(), report.tolerance
    lines.append(f"{'PASSED' if report.passed else 'FAILED'}: {decided(report)}")
    lines.append(
        f"figures: {s['cases']} cases, max abs err {s['max_abs_err']:.3e}, "
        f"max rel err {s['max_rel_err']:.3e} (an element's |onnx - torch| / |torch|: large where torch's value is "
        f"near 0, which the rule's atol covers), worst row relative RMS {s['max_row_rel_rms']:.3e}; "
        f"onnx vs float64 {s['max_onnx_vs_f64']:.3e}, torch vs float64 {s['max_torch_vs_f64']:.3e}, "
        f"float32's spread {s['max_spread']:.3e}; "
        f"float64 oracles (torch, numpy) agree to {s['max_oracles_gap']:.1e}"
    )
    lines.append(f"rule: {t.describe()}")
    lines.append(inputs_line(report))
    if not report.passed:
        lines.append(worst_message(report))
    return "\n".join(lines)


def inputs_line(report: ParityReport) -> str:
    """What the inputs were: real ones (--calibration) or synthetic only, said every time."""
    if report.inputs == "given":
        n = sum(r.representative for r in report.results)
        return (
            f"inputs: {n} cases of real inputs (--calibration FILE, or a text model's built-in sentences), judged for "
            "quality; the synthetic cases test the graph"
        )
    return (
        "inputs: synthetic (seeded random embeddings); for a trained model give real ones with --calibration "
        "FILE, on which a lossy variant's quality is then judged"
    )


def decided(report: ParityReport) -> str:
    """What decided the verdict, in words: how many cases passed within the tolerance of torch fp32 and how many
    by the float64 rule, and how close the worst comparison came to its allowance. The figures alone can exceed
    the printed atol/rtol on a passing run (the float64 rule passed those cases), so they are never shown alone.
    A lossy variant's two verdicts, quality and implementation, are each named."""
    s = report.summary()
    if "quality" in s:
        q, i = s["quality"], s["implementation"]
        quality = (
            "not judged (no representative case)"
            if q["passed"] is None
            else f"{'passed' if q['passed'] else 'FAILED'} on {q['cases']} representative cases (worst row "
            f"relative RMS {q['worst_row_rel_rms']:.3e}, least row cosine {q['least_row_cosine']:.5f}, least "
            f"sentence cosine {q['least_sentence_cosine']:.5f} vs fp32)"
        )
        impl = (
            "not judged (no scheme)"
            if i["passed"] is None
            else f"{'passed' if i['passed'] else 'FAILED'} (the graph's worst row is {i['worst_graph_vs_scheme']:.3e} "
            f"from its scheme, the scheme's {i['worst_scheme_vs_fp32']:.3e} from fp32)"
        )
        return (
            f"quality {quality}; implementation {impl}; the worst comparison is at {s['worst_ratio']:.2f}x its "
            "allowance (above 1 fails)"
        )
    failed = s["cases"] - s["cases_within_tolerance"] - s["cases_by_float64_rule"]
    text = (
        f"{s['cases_within_tolerance']} of {s['cases']} cases within the tolerance of torch fp32, "
        f"{s['cases_by_float64_rule']} by the float64 rule"
        + (f", {failed} failed" if failed else "")
        + f"; the worst comparison is at {s['worst_ratio']:.2f}x its allowance (above 1 fails)"
    )
    return text


def _verdict(c: Comparison) -> str:
    if c.quality is not None or c.implementation is not None:
        parts = [
            f"{name} {'ok' if v else 'FAIL'}"
            for name, v in (("quality", c.quality), ("impl", c.implementation))
            if v is not None
        ]
        return ", ".join(parts)
    if not c.passed:
        return "FAIL"
    return "ok" if c.within_tolerance else "ok (oracle)"


def write_report(report: ParityReport, out: Path) -> list[Path]:
    """Write parity.json, parity.md, errors_per_step.png and error_vs_conditioning.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        out / "parity.json",
        out / "parity.md",
        out / "errors_per_step.png",
        out / "error_vs_conditioning.png",
    ]
    paths[0].write_text(json.dumps(report.to_dict(), indent=2, default=_json_default) + "\n")
    paths[1].write_text(_markdown(report))
    _plot_histograms(report, paths[2])
    _plot_conditioning(report, paths[3])
    return paths


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _markdown(report: ParityReport) -> str:
    s = report.summary()
    t = report.tolerance
    lines = [
        "# Parity report",
        "",
        f"- result: **{'PASSED' if report.passed else 'FAILED'}** ({s['cases']} cases, variant {report.variant}): "
        f"{decided(report)}",
        f"- tolerance {t.describe()}",
        f"- providers: {', '.join(report.providers)}; graph optimization: {report.graph_optimization}",
        f"- max abs error {s['max_abs_err']:.3e}; torch fp32 vs float64 {s['max_torch_vs_f64']:.3e}; "
        f"onnxruntime vs float64 {s['max_onnx_vs_f64']:.3e}; the two float64 oracles (torch, and numpy in "
        f"model/reference.py) agree to {s['max_oracles_gap']:.1e}",
        "",
        "## Per Add & Norm step (max abs error over all cases)",
        "",
        "| output | max abs |",
        "| --- | --- |",
        *(f"| {name} | {err:.3e} |" for name, err in s["max_abs_err_per_step"].items()),
        "",
        "## Every case",
        "",
        "| case | output | max abs | max rel | mean | p99 | torch vs f64 | onnx vs f64 | f32 floor | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.results:
        for c in r.comparisons:
            verdict = _verdict(c)
            lines.append(
                f"| {r.case} | {c.output} | {c.max_abs:.2e} | {c.max_rel:.2e} | {c.mean_abs:.2e} | {c.p99_abs:.2e} "
                f"| {c.torch_vs_f64:.2e} | {c.onnx_vs_f64:.2e} | {c.float32_floor:.2e} | {verdict} |"
            )
    lines += ["", "Plots: `errors_per_step.png`, `error_vs_conditioning.png`.", ""]
    return "\n".join(lines)


def _plot_histograms(report: ParityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.samples)
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 1.6 * len(names) + 1), squeeze=False, sharex=True)
    for ax, name in zip(axes[:, 0], names, strict=True):
        errs = np.concatenate(report.samples[name])
        ax.hist(np.log10(np.maximum(errs, 1e-12)), bins=60, color="tab:blue")
        ax.set_ylabel(name, rotation=0, ha="right", fontsize=8)
        if report.tolerance.atol is not None:
            ax.axvline(math.log10(report.tolerance.atol), color="tab:red", lw=1, ls="--")
    axes[-1, 0].set_xlabel("log10 |onnxruntime - torch fp32| (dashed: atol; -12: exactly equal)")
    title = (
        "Errors per Add & Norm step"
        if len(names) > 1
        else f"Errors of the {names[0]} output only (--no-steps)"
    )
    fig.suptitle(f"{title} ({report.variant}, {len(report.results)} cases)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_conditioning(report: ParityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cond = np.array([min(r.condition, 1e12) for r in report.results])
    x = np.log10(np.maximum(cond, 1e-3))
    torch_err = np.array([max(r.final.torch_vs_f64, 1e-12) for r in report.results])
    onnx_err = np.array([max(r.final.onnx_vs_f64, 1e-12) for r in report.results])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(x, np.log10(torch_err), label="torch fp32 vs float64", marker="o", alpha=0.7)
    ax.scatter(x, np.log10(onnx_err), label="onnxruntime vs float64", marker="x", alpha=0.9)
    ax.set_xlabel("log10 input conditioning (max |mean| / std over positions)")
    ax.set_ylabel("log10 max abs error vs float64")
    ax.set_title("Error against the float64 oracle vs input conditioning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
