"""What a running server holds (its settings, metrics, the CPU thread budget, and once the manifests are read the
models it serves: service/models/registry.py), and when its models load: at start-up and by model control.

At start-up (``load_models``) every manifest is read first (names known, so model routes can answer 404 and 503 by
name), then each model loads in parallel, each ending READY or UNAVAILABLE with its reason (the registry's
``load_all``). What one load builds is ``serving_model`` (the registry's ``build``): the engine, its golden check
on this server's provider (its ``verify``), the batcher. ``load_then_watch`` is the
start-up policy: stop a server that can serve nothing, or watch the repository.

Model control (Triton's model repository extension): load, unload and reload the repository's models while
serving, on every transport (HTTP ``POST /v2/repository/models/{name}/load|unload``, gRPC RepositoryModelLoad /
RepositoryModelUnload) and by watching the repository (``--model-control-mode poll``). ``ModelControl`` decides
when (the mode, what a poll finds changed, a refused version not retried until it changes); the registry does it:
a verified swap, where a new or changed model loads beside the one serving, passes its sha256 and golden check on
this provider and only then takes the name's traffic, the old one draining; a version that fails never takes
traffic, the index saying why. Loads and unloads of one name run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from addnorm.service.backend.cores import CoreBudget, default_threads, threads_for
from addnorm.service.backend.engine import Engine, accept
from addnorm.service.backend.interface import Backend
from addnorm.service.batching.batcher import Batcher
from addnorm.service.batching.merging import Costs, Observers, measure_costs
from addnorm.service.errors import BadInput, ControlOff, LoadRefused, NotFound, ServiceError, quote
from addnorm.service.metrics import Metrics, ModelStatistics
from addnorm.service.models.live_parity import LiveParity
from addnorm.service.models.registry import (
    LoadFailed,
    Registry,
    ServingModel,
    read_manifests,
    repository_models,
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
    (``loaded``) and why nothing can be served (``load_error``, ``fatal``)."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    loaded: KnownModels | None = None  # set once every model's manifest is read (names known)
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
            self.settings, lambda: self.loaded.models if self.loaded is not None else None
        )

    def mark_unready(self, name: str, reason: str) -> None:
        """Live parity's action ``unready`` (service.models.registry.Registry.mark_unready)."""
        if self.loaded is not None:
            self.loaded.models.mark_unready(name, reason)

    def not_ready_reason(self) -> str | None:
        """None when every model is loaded; otherwise why not."""
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        if self.loaded is None:
            return "model is loading"
        return self.loaded.models.not_ready_reason()


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
    state.loaded = KnownModels(settings, models)
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
        # the one place a backend is built (service/backend/interface.py): everything after speaks to Backend
        engine: Backend = await asyncio.to_thread(Engine, directory, s.providers, threads, s.kernels)
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
        max_batch_tokens=s.max_batch_tokens,
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
        loaded = state.loaded
        if state.load_error or (loaded is not None and not any(True for _ in loaded.models)):
            state.fatal = state.not_ready_reason() or "no model could be loaded"
            log.error("no model can be served, stopping (--model-control-mode none): %s", state.fatal)
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop; the CLI then exits 1
    elif settings.model_control_mode == "poll":
        await state.control.watch()


class ModelControl:
    """What the load/unload routes, the gRPC methods and the poller call; one per server (``state.control``)."""

    def __init__(self, settings: Settings, models: Callable[[], Registry | None]) -> None:
        self.settings = settings
        self.models = models  # the registry, None until the manifests are read
        self.mode = settings.model_control_mode
        self._refused: dict[str, tuple[Path, str]] = {}  # name -> (directory, model sha256) not to retry

    def _allowed(self) -> None:
        if self.mode != "explicit":
            how = "--model-control-mode explicit" if self.mode == "none" else "the poller (mode poll) does it"
            raise ControlOff(f"explicit model load / unload is not allowed here: {how}")

    def _models(self) -> Registry:
        models = self.models()
        if models is None:
            raise ControlOff("the server is still reading its models' manifests")
        return models

    async def load(self, name: str) -> None:
        """Load (or reload) ``name`` from the repository; raises NotFound, LoadRefused or ControlOff."""
        self._allowed()
        await self._load(name)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` once its requests in flight are answered; raises NotFound or ControlOff."""
        self._allowed()
        await self._models().unload(name)

    async def _load(self, name: str) -> None:
        repo, unreadable = self.settings.model_repository, {}
        entry = repository_models(repo, unreadable, self.settings.follow_symlinks).get(name)
        if entry is None:
            # A model whose manifest cannot be read has no name to find it by: its repository entry (Triton's
            # layout, repository/NAME/[VERSION/]) is named after it, and the refusal says why it cannot load.
            named = [
                (d, why)
                for d, why in unreadable.items()
                if repo is not None and d.relative_to(repo).parts[0] == name
            ]
            if named:
                directory, why = named[0]
                raise LoadRefused(f"model {quote(name)}: {directory} cannot be loaded: {why}")
            raise NotFound(f"no model {quote(name)} in the repository {repo}")
        directory, manifest = entry
        try:
            await self._models().load(name, directory)
        except LoadFailed as exc:
            self._refused[name] = (directory, manifest.model_sha256)
            raise LoadRefused(f"model {quote(name)}: {exc}") from None
        self._refused.pop(name, None)

    async def poll(self) -> None:
        """One look at the repository (mode poll): load what is new or changed, unload what is gone."""
        models = self.models()
        if models is None:
            return
        repo = self.settings.model_repository
        found = repository_models(repo, follow_symlinks=self.settings.follow_symlinks)
        for name, (directory, manifest) in found.items():
            slot = models.slots.get(name)
            sha = manifest.model_sha256
            if self._refused.get(name) == (directory, sha):
                continue  # refused as it is: tried again once it changes
            serving = slot.serving if slot is not None else None
            if (
                serving is not None
                and slot.directory == directory
                and serving.engine.manifest.model_sha256 == sha
            ):
                continue
            with contextlib.suppress(ServiceError):  # refusals are logged and in the index
                await self._load(name)
        for name, slot in list(models.slots.items()):
            from_repo = repo is not None and slot.directory.is_relative_to(repo)  # not a --artifact's
            if name not in found and from_repo and slot.serving is not None:
                await models.unload(name)

    async def watch(self) -> None:
        """The poller: every ``--repository-poll-secs`` until cancelled."""
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.poll()
            except Exception:  # never the poller
                log.exception("reading the model repository failed")


def check_parameters(names: list[str], unload: bool = False) -> None:
    """A load's or unload's parameters. Triton's ``config`` override and ``file:`` uploads are not taken (the
    repository on disk is what loads, verified); an unload's ``unload_dependents`` (which tritonclient always
    sends) is accepted, as no model here depends on another; anything else is refused rather than ignored."""
    unknown = sorted(set(names) - ({"unload_dependents"} if unload else set()))
    if unknown:
        raise BadInput(
            f"{'unload' if unload else 'load'} parameters {quote(unknown, 200)} are not supported here: put the "
            "model's files in the repository and load it by name"
        )
