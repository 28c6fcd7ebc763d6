"""What a running server holds (its settings, metrics, the CPU thread budget, and once the manifests are read the
models it serves: service/models/registry.py), and when its models load: at start-up and by model control.

At start-up (``load_models``) every manifest is read first (names known, so model routes can answer 404 and 503 by
name), then each model loads in parallel, each ending READY or UNAVAILABLE with its reason (the registry's
``load_all``). What one load builds is ``serving_model`` (the registry's ``build``): the engine, its golden check
on this server's provider (its ``verify``), the batcher. ``load_then_watch`` is the
start-up policy: stop a server that can serve nothing, or watch the repository.

Model control (loading while serving) is service/models/control.py's ``ModelControl``, which the state holds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from addnorm.service.backend.cores import CoreBudget, default_threads, threads_for
from addnorm.service.backend.engine import Engine, accept
from addnorm.service.backend.interface import Backend
from addnorm.service.batching.batcher import Batcher
from addnorm.service.batching.merging import Costs, Observers, measure_costs
from addnorm.service.metrics import Metrics, ModelStatistics
from addnorm.service.models.control import ModelControl
from addnorm.service.models.live_parity import LiveParity
from addnorm.service.models.registry import (
    LoadFailed,
    Registry,
    ServingModel,
    read_manifests,
)
from addnorm.service.settings import Settings

log = logging.getLogger("addnorm.service")


@dataclass(frozen=True)
class KnownModels:
    """What routes past the guard get once every manifest is read: the settings and the models by name."""

    settings: Settings
    models: Registry


@dataclass
class ServiceState:
    """Built whole: what lives as long as the server (the parsed API keys, the thread budget, live parity, model
    control) is made here, once; what changes while it serves is the registry once the manifests are read
    (``known``) and why nothing can be served (``load_error``, ``fatal``)."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    known: KnownModels | None = None  # set once every model's manifest is read (names known)
    load_error: str | None = None  # the manifests could not be read: nothing is served
    fatal: str | None = None  # why the server stopped itself (no model loadable with model control off)
    api_keys: tuple[bytes, ...] = field(init=False)  # parsed once, for the guard of every transport
    cores: CoreBudget = field(init=False)  # the CPU thread budget every model's runs draw from (settings')
    live: LiveParity = field(
        init=False
    )  # a sample of answers recomputed in float64 (its thread starts with the app)
    control: ModelControl = field(init=False)  # load / unload / poll (HTTP routes, gRPC methods, the poller)

    def __post_init__(self) -> None:
        self.api_keys = tuple(key.encode() for key in self.settings.api_keys())
        self.cores = CoreBudget(self.settings.thread_budget or default_threads(self.settings.workers))
        self.live = LiveParity.from_settings(self.settings, self.metrics, unready=self.mark_unready)
        self.control = ModelControl(
            self.settings, lambda: self.known.models if self.known is not None else None
        )

    def mark_unready(self, name: str, reason: str) -> None:
        """Live parity's action ``unready`` (service.models.registry.Registry.mark_unready)."""
        if self.known is not None:
            self.known.models.mark_unready(name, reason)

    def not_ready_reason(self) -> str | None:
        """None when every model is loaded; otherwise why not."""
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        if self.known is None:
            return "model is loading"
        return self.known.models.not_ready_reason()


async def get_state(request: Request) -> ServiceState:
    """The server's state, for routes that work before the models load (probes, metrics)."""
    return request.app.state.addnorm


State = Annotated[ServiceState, Depends(get_state)]


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
    state.known = KnownModels(settings, models)
    await models.load_all()
    if state.not_ready_reason() is None:
        log.info("ready: %s", ", ".join(f"{s.name} on {s.serving.engine.providers}" for s in slots))


async def serving_model(state: ServiceState, name: str, directory: Path, version: str = "1") -> ServingModel:
    """The model ``name`` (its manifest's) in ``directory``, verified and with its batcher started; raises
    LoadFailed."""
    s = state.settings
    models = len(state.known.models.slots) if state.known is not None else 1
    threads = threads_for(s, name, state.cores.threads, models)
    try:
        # the one place a backend is built (service/backend/interface.py): everything after speaks to Backend
        engine: Backend = await asyncio.to_thread(
            Engine, directory, s.providers, threads, s.kernels, s.intra_op_spinning, s.parallel_runs == "on"
        )
    except Exception as exc:  # any failure keeps the model (and /health/ready) unavailable, with the reason
        raise LoadFailed(str(exc)) from None
    try:
        verification = await asyncio.to_thread(engine.verify, s.verify_on_load)
    except Exception as exc:  # unreadable golden data: not ready, with the reason
        raise LoadFailed(f"golden check could not run: {type(exc).__name__}: {exc}") from None
    state.metrics.verification(engine.name, verification)
    if not accept(verification, s.verify_on_load, engine.name):
        raise LoadFailed(f"golden check failed on {verification.provider}: {verification.message}")
    costs = Costs(0.0, engine.packed)
    if s.merge_lengths == "cost" and s.max_batch_size > 1:
        costs = await asyncio.to_thread(measure_costs, engine, engine.d_model, engine.packed)
        log.info("%s: merging by cost, measured: %s", engine.name, costs)
    statistics = ModelStatistics(engine.name, version)
    # The queue-depth gauge reads the batcher (made just below) at each scrape.
    metrics = state.metrics.model(engine.name, queue_depth=lambda: batcher.depth)
    batcher = Batcher(
        engine,
        max_batch_size=s.max_batch_size,
        max_batch_tokens=engine.manifest.config.run_tokens(s.max_batch_tokens),
        max_queue_delay_ms=s.max_queue_delay_ms,
        max_queue_size=s.max_queue_size,
        observer=Observers(metrics, statistics),
        max_batch_attention=s.max_batch_attention,
        heads=engine.heads,
        attention=engine.held_attention,
        max_queue_bytes=s.max_queue_bytes,
        cores=state.cores if engine.on_cpu else None,  # a GPU run holds no CPU threads to speak of
        merge=s.merge_lengths,
        costs=costs,
        express_tokens=s.express_tokens,
    )
    batcher.start()
    return ServingModel(engine, batcher, verification, statistics, version, live=state.live)


async def load_then_watch(state: ServiceState, exit_on_error: bool) -> None:
    """Load the models; then, with model control off, stop the server when none could be (Triton's
    exit-on-error: a server that can never answer should not look alive; ``exit_on_error``: only addnorm-serve's
    own process, never an app hosted in another); in poll mode, watch the repository."""
    await load_models(state)
    settings = state.settings
    if settings.model_control_mode == "none" and exit_on_error:
        known = state.known
        if state.load_error or (known is not None and not any(True for _ in known.models)):
            state.fatal = state.not_ready_reason() or "no model could be loaded"
            log.error("no model can be served, stopping (--model-control-mode none): %s", state.fatal)
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop; the CLI then exits 1
    elif settings.model_control_mode == "poll":
        await state.control.watch()
