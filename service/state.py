"""What a running server holds: its settings, metrics, and the models it serves, each with its loading state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Protocol

from fastapi import Depends, Request

from model.golden import Verification
from service.batcher import Batcher
from service.cores import CoreBudget
from service.engine import Engine, default_threads
from service.errors import NotFound, NotReady, quote
from service.live_parity import LiveParity
from service.metrics import Metrics
from service.settings import Settings
from service.statistics import ModelStatistics


class RequestGuard(Protocol):
    """What ``ServiceState.guard`` holds (service.guard.Guard), without state importing guard."""

    def check(self, path: str, credentials: Callable[[], Sequence[bytes]]) -> KnownModels | None: ...


class InFlight:
    """The requests using a model right now (``with model.inflight:`` in the request core), so that a model
    being replaced or unloaded is stopped only once the last of them is answered (``idle``)."""

    __slots__ = ("count", "_idle")

    def __init__(self) -> None:
        self.count = 0
        self._idle: asyncio.Event | None = None

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        while self.count:
            self._idle = asyncio.Event()
            await self._idle.wait()


class ModelController(Protocol):
    """What ``ServiceState.control`` holds (service.control.ModelControl), without state importing control."""

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...

    async def watch(self) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ServingModel:
    """One loaded model: its engine, the batcher in front of it, its load-time check, its statistics and the
    version it serves (its numbered directory in a repository, else "1")."""

    engine: Engine
    batcher: Batcher
    verification: Verification  # the load-time golden check (service.verification)
    statistics: ModelStatistics
    version: str = "1"
    inflight: InFlight = field(default_factory=InFlight, compare=False)

    def describe(self) -> dict:
        """The manifest, what runs it, and how it verified (GET /v1/model)."""
        return {**self.engine.describe(), "verification": self.verification.to_dict()}

    @property
    def name(self) -> str:
        return self.engine.name


log = logging.getLogger("addnorm.service")
LOADING, READY, UNAVAILABLE = "LOADING", "READY", "UNAVAILABLE"  # the repository index's states
UNLOADED = "unloaded"  # the reason of a model model control unloaded


@dataclass
class Slot:
    """One model the server was told to serve, from the moment its manifest is read: its state, and the
    ServingModel once it is READY. ``reason`` says why it is UNAVAILABLE."""

    name: str
    directory: Path
    state: str = LOADING
    reason: str = ""
    serving: ServingModel | None = None
    version: str = "1"  # the version it serves, or is loading


class Models:
    """The configured models by name, in the order given; the first is the default. What the guard hands to every
    route past it: ``get`` answers 404 for a name it does not know and 503 for a model not (yet) loaded."""

    def __init__(self, slots: list[Slot], allow_empty: bool = False) -> None:
        if not slots and not allow_empty:
            raise ValueError("a server needs at least one model")
        self.slots = {s.name: s for s in slots}

    def add(self, slot: Slot) -> Slot:
        """A model that model control loads (service/control.py); the existing slot when the name is known."""
        return self.slots.setdefault(slot.name, slot)

    def slot(self, name: str) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise NotFound(f"unknown model {quote(name)}; this server serves {sorted(self.slots)}") from None

    def get(self, name: str | None = None) -> ServingModel:
        """The named model (the default for None), loaded; NotFound or NotReady otherwise."""
        if name is None:
            if not self.slots:
                raise NotReady(
                    "no model is loaded (model control: load one with POST /v2/repository/models/NAME/load)"
                )
            slot = next(iter(self.slots.values()))
        else:
            slot = self.slot(name)
        if slot.serving is None or slot.state != READY:  # (live parity may have made a loaded one unready)
            raise NotReady(_why(slot))
        return slot.serving

    @property
    def default(self) -> ServingModel:
        return self.get()

    def __iter__(self) -> Iterator[ServingModel]:
        """The loaded models."""
        return (s.serving for s in self.slots.values() if s.serving is not None)

    def not_ready_reason(self) -> str | None:
        """None when every model is READY (an unloaded one aside); otherwise each other model's state."""
        waiting = [_why(s) for s in self.slots.values() if s.state != READY and s.reason != UNLOADED]
        return "; ".join(waiting) or None


def _why(slot: Slot) -> str:
    if slot.state == UNAVAILABLE:
        if slot.reason == UNLOADED:
            return f"model {slot.name!r} is unloaded"
        if slot.serving is not None:  # loaded, then taken out of service (live parity)
            return f"model {slot.name!r} is unavailable: {slot.reason}"
        return f"model {slot.name!r} failed to load: {slot.reason}"
    return f"model {slot.name!r} is loading"


@dataclass(frozen=True)
class KnownModels:
    """What routes past the guard get once every manifest is read: the settings, the models by name, and the
    live parity sampler every answered request is offered to (service/live_parity.py; None in bare tests)."""

    settings: Settings
    models: Models
    live: LiveParity | None = None


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    loaded: KnownModels | None = None  # set once every model's manifest is read (names known)
    load_error: str | None = None  # the manifests could not be read: nothing is served
    api_keys: tuple[bytes, ...] = field(init=False)  # parsed once, for the guard of every transport
    guard: RequestGuard | None = None  # set by create_app; the gRPC server's interceptor asks the same one
    control: ModelController | None = None  # service.control.ModelControl, set by create_app
    fatal: str | None = None  # why the server stopped itself (no model loadable with model control off)
    live: LiveParity | None = None  # set by create_app
    cores: CoreBudget = field(init=False)  # the CPU thread budget every model's runs draw from (settings')

    def __post_init__(self) -> None:
        self.api_keys = tuple(key.encode() for key in self.settings.api_keys())
        self.cores = CoreBudget(self.settings.thread_budget or default_threads(self.settings.workers))

    def mark_unready(self, name: str, reason: str) -> None:
        """Live parity's action ``unready`` (on the event loop): the model answers 503 with the reason, and the
        index, /health/ready and gRPC ModelReady say so, until it is loaded again."""
        slot = self.loaded.models.slots.get(name) if self.loaded is not None else None
        if slot is not None and slot.state == READY:
            slot.state, slot.reason = UNAVAILABLE, reason
            log.error("model %s is now UNAVAILABLE: %s", name, reason)

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
