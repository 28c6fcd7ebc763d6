"""What a running server holds: its settings, metrics, and the models it serves once they are loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from model.golden import Verification
from service.batcher import Batcher
from service.engine import Engine
from service.errors import NotFound
from service.metrics import Metrics
from service.settings import Settings


@dataclass(frozen=True)
class ServingModel:
    """One served model: its engine and the batcher in front of it."""

    engine: Engine
    batcher: Batcher
    verification: Verification  # the load-time golden check (service.verification)

    def describe(self) -> dict:
        """The manifest, what runs it, and how it verified (GET /v1/model)."""
        return {**self.engine.describe(), "verification": self.verification.to_dict()}

    @property
    def name(self) -> str:
        return self.engine.name


class Models:
    """The loaded models by name; the first is the default. What the guard hands to every route past it."""

    def __init__(self, models: list[ServingModel]) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self._by_name = {m.name: m for m in models}
        self.default = models[0]

    def get(self, name: str) -> ServingModel:
        try:
            return self._by_name[name]
        except KeyError:
            raise NotFound(f"unknown model {name!r}; this server serves {sorted(self._by_name)}") from None

    def __iter__(self):  # noqa: ANN204
        return iter(self._by_name.values())


@dataclass(frozen=True)
class LoadedState:
    """What routes past the guard get: nothing in it is optional."""

    settings: Settings
    models: Models


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    loaded: LoadedState | None = None  # set once every model has loaded
    load_error: str | None = None

    def not_ready_reason(self) -> str | None:
        """None when every model is loaded; otherwise why not."""
        if self.loaded is not None:
            return None
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        return "model is loading"


async def get_state(request: Request) -> ServiceState:
    """The server's state, for routes that work before the models load (probes, metrics)."""
    return request.app.state.addnorm


State = Annotated[ServiceState, Depends(get_state)]
