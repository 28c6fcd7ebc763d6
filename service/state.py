"""What a running server holds: its settings, metrics, the CPU thread budget, and once the manifests are read the
models it serves (service/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.control import ModelControl
from service.cores import CoreBudget, default_threads
from service.live_parity import LiveParity
from service.metrics import Metrics
from service.registry import Registry
from service.settings import Settings


@dataclass(frozen=True)
class KnownModels:
    """What routes past the guard get once every manifest is read: the settings, the models by name, and the
    live parity sampler every answered request is offered to (service/live_parity.py; None in bare tests)."""

    settings: Settings
    models: Registry
    live: LiveParity | None = None


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
        """Live parity's action ``unready`` (service.registry.Registry.mark_unready)."""
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
