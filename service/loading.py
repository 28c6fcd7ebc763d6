"""Loading the models a server is given: every manifest first (names known, so model routes can answer 404 and
503 by name), then each model in parallel, each ending READY or UNAVAILABLE with its reason (the registry's
``load_all``). What one load builds: the engine, its golden check on this server's provider (``verify_engine``),
the batcher (``serving_model``, the registry's ``build``).

The golden check is parity where it is served: the artifact's golden inputs run through this server's own
session, on the provider it serves with, judged by the export gate's rule (model.verdict) under the variant's
tolerance. The sha256 proves the file is the one exported; this proves the runtime here computes what was checked
there (another onnxruntime build, another CPU, the CUDA provider's kernels).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
from pathlib import Path

from model.golden import Verification, load_golden, verify
from model.runtime import CPU, VNNI_FLAGS, cpu_flags
from model.verdict import Tolerance
from service.batcher import Batcher, Observers
from service.cores import threads_for
from service.engine import Engine
from service.merging import measure_fixed_cost
from service.registry import LoadFailed, Registry, ServingModel, read_manifests
from service.state import KnownModels, ServiceState
from service.statistics import ModelStatistics

log = logging.getLogger("addnorm.service")


async def load_models(state: ServiceState) -> None:
    """Read every manifest (names known: model routes answer 404/503 by name from here on), then load the
    models in parallel; each becomes READY or UNAVAILABLE with its reason."""
    settings = state.settings
    try:
        slots = read_manifests(settings)
    except ValueError as exc:
        state.load_error = str(exc)
        log.error("cannot serve: %s", exc)
        return
    if settings.model_control_mode == "explicit" and "*" not in settings.load_model:  # only those asked for
        unknown = set(settings.load_model) - {s.name for s in slots}
        if unknown:
            log.error("--load-model: no model %s in the repository", ", ".join(sorted(unknown)))
        slots = [s for s in slots if s.name in settings.load_model]
    build = functools.partial(serving_model, state)
    models = Registry(slots, build, allow_empty=settings.model_control_mode != "none")
    state.loaded = KnownModels(settings, models, state.live)
    await models.load_all()
    if state.not_ready_reason() is None:
        log.info("ready: %s", ", ".join(f"{s.name} on {s.serving.engine.providers}" for s in slots))


async def serving_model(state: ServiceState, name: str, directory: Path, version: str = "1") -> ServingModel:
    """The model ``name`` (its manifest's) in ``directory``, verified and with its batcher started; raises
    LoadFailed."""
    s = state.settings
    models = len(state.loaded.models.slots) if state.loaded is not None else 1
    threads = threads_for(s, name, state.cores.threads, models)
    try:
        engine = await asyncio.to_thread(Engine, directory, s.providers, threads)
    except Exception as exc:  # any failure keeps the model (and /health/ready) unavailable, with the reason
        raise LoadFailed(str(exc)) from None
    try:
        verification = await asyncio.to_thread(verify_engine, engine, s.verify_on_load)
    except Exception as exc:  # unreadable golden data: not ready, with the reason
        raise LoadFailed(f"golden check could not run: {type(exc).__name__}: {exc}") from None
    state.metrics.verification(engine.name, verification)
    if not _accept(verification, s.verify_on_load, engine.name):
        raise LoadFailed(f"golden check failed on {verification.provider}: {verification.message}")
    fixed_cost = 0.0
    if s.merge_lengths == "cost" and s.max_batch_size > 1:
        fixed_cost = await asyncio.to_thread(measure_fixed_cost, engine, engine.manifest.config.d_model)
        log.info("%s: a run's fixed cost is %.0f token-positions (merging by cost)", engine.name, fixed_cost)
    statistics = ModelStatistics(engine.name, version)
    # The queue-depth gauge reads the batcher (made just below) at each scrape.
    metrics = state.metrics.model(engine.name, queue_depth=lambda: batcher.depth)
    batcher = Batcher(
        engine,
        max_batch_size=s.max_batch_size,
        max_batch_tokens=s.max_batch_tokens,
        max_queue_delay_ms=s.max_queue_delay_ms,
        max_queue_size=s.max_queue_size,
        observer=Observers(metrics, statistics),
        max_batch_attention=s.max_batch_attention,
        heads=engine.manifest.config.nhead,
        attention=engine.attention,
        max_queue_bytes=s.max_queue_bytes,
        cores=state.cores
        if engine.providers[0] == CPU
        else None,  # a GPU run holds no CPU threads to speak of
        merge=s.merge_lengths,
        fixed_cost=fixed_cost,
    )
    batcher.start()
    return ServingModel(engine, batcher, verification, statistics, version)


def _accept(v: Verification, mode: str, name: str) -> bool:
    """Log the load-time check in one line; False when it failed under strict (the model is not served)."""
    if v.status == "passed":
        log.info(
            "golden check passed for %s on %s: max abs err %.3e (%d cases, %.2f s)",
            name,
            v.provider,
            v.max_abs_err,
            v.cases,
            v.seconds,
        )
        return True
    if v.status == "failed" and mode == "strict":
        log.error(
            "golden check FAILED for %s, refusing to serve (ADDNORM_VERIFY_ON_LOAD=strict): %s",
            name,
            v.message,
        )
        return False
    log.warning("golden check %s for %s: %s", v.status.upper(), name, v.message)
    return True


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


async def load_then_watch(state: ServiceState, exit_on_error: bool) -> None:
    """Load the models; then, with model control off, stop the server when none could be (Triton's
    exit-on-error: a server that can never answer should not look alive; ``exit_on_error``: only addnorm-serve's
    own process, never an app hosted in another); in poll mode, watch the repository."""
    await load_models(state)
    settings = state.settings
    if settings.model_control_mode == "none" and exit_on_error:
        loaded = state.loaded
        if state.load_error or (loaded is not None and not any(True for _ in loaded.models)):
            state.fatal = state.not_ready_reason() or "no model could be loaded"
            log.error("no model can be served, stopping (--model-control-mode none): %s", state.fatal)
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop; the CLI then exits 1
    elif settings.model_control_mode == "poll":
        await state.control.watch()
