"""What the routes share: settings, the engine once loaded, the runner, metrics. Injected with Depends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.engine import Engine
from service.errors import Unavailable
from service.metrics import Metrics
from service.runner import Runner
from service.settings import Settings


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    runner: Runner | None = None
    load_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.runner is not None

    def not_ready_message(self) -> str:
        if self.load_error:
            return f"model failed to load: {self.load_error}"
        return "model is loading"


# Dependencies are async on purpose: FastAPI runs a plain ``def`` dependency in a worker thread, a hop that
# cost more than the rest of a small request's handling (bench/).
async def get_state(request: Request) -> ServiceState:
    return request.app.state.addnorm


async def get_ready_state(state: Annotated[ServiceState, Depends(get_state)]) -> ServiceState:
    if not state.ready:
        raise Unavailable(state.not_ready_message(), headers={"Retry-After": "1"})
    return state


State = Annotated[ServiceState, Depends(get_state)]
ReadyState = Annotated[ServiceState, Depends(get_ready_state)]
