"""A lean dispatcher for the inference routes, in front of FastAPI's router, middleware and dependencies.

On a 2-core machine every request's Python work competes with onnxruntime for the same cores, and FastAPI's
generic machinery (route matching, dependency solving, exception middleware) was about half of it (bench/).
Each protocol lists its hot routes as ``FastRoute``s; their handlers are the very functions its FastAPI routes
call (those stay registered for the OpenAPI docs). It sits inside the guard, so nothing here skips it.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import ServiceError
from service.guard import loaded_state
from service.responses import from_error, unexpected_error
from service.state import KnownModels

Handler = Callable[[Request, KnownModels, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    """``method`` + a full-path regex whose named groups become the handler's params; ``path`` is the route's
    template as FastAPI knows it (the metrics label)."""

    method: str
    pattern: re.Pattern[str]
    path: str
    handler: Handler


class FastPath:
    """Pure ASGI: requests matching a FastRoute go straight to its handler; everything else on to FastAPI."""

    def __init__(self, app: ASGIApp, routes: tuple[FastRoute, ...]) -> None:
        self.app = app
        self.routes = [(r, SimpleNamespace(path=r.path)) for r in routes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route, label in self.routes:
                if scope["method"] == route.method and (m := route.pattern.match(scope["path"])):
                    scope["route"] = label  # what the request context reads for its metrics
                    await self._dispatch(route, m.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _dispatch(route: FastRoute, params: dict, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await route.handler(request, await loaded_state(request), params)
        except ServiceError as exc:  # ClientGone included
            response = from_error(exc)
        except Exception as exc:  # same contract as the app's handler
            response = unexpected_error(exc, scope["method"], scope["path"])
        await response(scope, receive, send)
