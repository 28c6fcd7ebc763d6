"""The parity gate, one function for both ``addnorm-export`` and ``addnorm-parity``."""

from __future__ import annotations

import tempfile
from pathlib import Path

from addnorm.export.cases import Case
from addnorm.export.parity import SEED, ParityReport, make_session, run_parity
from addnorm.export.report import failure_message
from addnorm.export.variants import build_graph, get_variant
from addnorm.model.encoder import Encoder


class ParityError(RuntimeError):
    """The exported graph does not match torch within tolerance; no manifest was written."""

    def __init__(self, report: ParityReport) -> None:
        super().__init__(failure_message(report))
        self.report = report


def gate(
    encoder: Encoder,
    model_path: str | Path,
    variant: str,
    opset: int,
    cases: list[Case] | None = None,
    *,
    steps: bool = True,
    graph_optimization: str = "all",
    seed: int = SEED,
    attention: str = "decomposed",
    providers: list[str] | None = None,
    keep: frozenset[str] = frozenset(),
    plan: dict | None = None,
) -> ParityReport:
    """Run the graph at ``model_path`` against ``encoder`` under the variant's tolerance.

    With ``steps``, a debug graph of the same variant and attention form (every Add & Norm result as an extra output) is built in a
    temporary directory, so each step is compared too and a drift names its sublayer. ``plan``: the variant's
    scheme parameters (the manifest's ``scheme``), for the debug graph and the scheme alike.
    """
    session = make_session(model_path, graph_optimization, providers)
    with tempfile.TemporaryDirectory() as tmp:
        debug = None
        if steps:
            debug_path = Path(tmp) / "debug.onnx"
            build_graph(encoder, debug_path, variant, opset, with_steps=True, attention=attention, plan=plan)
            debug = make_session(debug_path, graph_optimization, providers)
        v = get_variant(variant)
        scheme, scheme_model = v.for_run(plan)
        return run_parity(
            encoder,
            session,
            cases,
            tol=v.tolerance,
            scheme=scheme,
            scheme_ulp=v.input_precision,
            scheme_model=scheme_model,
            seed=seed,
            graph_optimization=graph_optimization,
            debug_session=debug,
            variant=variant,
            keep=keep,
        )
