"""A lean dispatcher for the two inference routes, in front of FastAPI's router, middleware and dependencies.

On a 2-core machine every request's Python work competes with onnxruntime for the same cores, and FastAPI's
generic machinery (route matching, dependency solving, exception middleware) was about half of it (bench/).
This calls the very same route functions (``v1.encode``, ``v2.model_infer``), which stay registered with
FastAPI for the OpenAPI docs, and maps errors exactly as the app's handlers do.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import ApiError, error_response, unexpected_error
from service.routes import v1, v2
from service.state import ServiceState, get_ready_state

_V2_INFER = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
_V2_ROUTE = SimpleNamespace(path="/v2/models/{name}/infer")  # the metrics label, as FastAPI would set it
_V1_ROUTE = SimpleNamespace(path="/v1/encode")


class InferenceRoutes:
    """Pure ASGI: ``POST /v1/encode`` and ``POST /v2/models/{name}[/versions/{v}]/infer`` go straight to their
    route functions; everything else goes on to FastAPI."""

    def __init__(self, app: ASGIApp, state: ServiceState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/v1/encode":
            scope["route"] = _V1_ROUTE
            call = lambda req, st: v1.encode(req, st)  # noqa: E731
        elif (m := _V2_INFER.match(path)) is not None:
            scope["route"] = _V2_ROUTE
            name, version = m["name"], m["version"]
            call = lambda req, st: v2.model_infer(name, req, st, version)  # noqa: E731
        else:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await call(request, await get_ready_state(self.state))
        except ApiError as exc:  # ClientGone included
            response = error_response(exc.status, exc.message, exc.headers)
        except Exception as exc:  # same contract as the app's handler
            response = unexpected_error(exc, "POST", path)
        await response(scope, receive, send)
