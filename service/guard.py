"""The one request guard. Every HTTP request passes it before any route, the fast path's or FastAPI's.

It lets the health probes through untouched; every other path needs a valid API key when keys are set
(``Authorization: Bearer <key>``, compared in constant time), and model routes need the models' manifests read
(each route then answers 503 for a model still loading, 404 for a name no manifest has). A route
that needs the models gets them from the guard (``Loaded``), so a model route the guard did not cover fails
loudly instead of serving unguarded; ``tests/service/test_guard.py`` tries every route the app serves.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import NotReady, ServiceError, Unauthenticated
from service.responses import from_error
from service.state import LoadedState, ServiceState

SCOPE_KEY = "addnorm.loaded"  # where the guard leaves the LoadedState for the routes past it


class Guard:
    """Pure ASGI middleware. ``public_paths``: served without checks (health probes); ``model_prefixes``: paths
    whose routes use the models, refused with 503 until the manifests are read; ``api_keys``: none = open."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServiceState,
        public_paths: frozenset[str],
        model_prefixes: tuple[str, ...],
        api_keys: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.state = state
        self.public_paths = public_paths
        self.model_prefixes = model_prefixes
        self.api_keys = tuple(key.encode() for key in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                loaded = self.check(scope)
            except ServiceError as exc:
                await from_error(exc)(scope, receive, send)
                return
            if loaded is not None:
                scope[SCOPE_KEY] = loaded
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> LoadedState | None:
        """Raise a ServiceError to refuse the request; return the loaded state for model routes."""
        path = scope["path"]
        if path in self.public_paths:
            return None
        if self.api_keys:
            self._authenticate(scope)
        if not path.startswith(self.model_prefixes):
            return None
        if self.state.loaded is None:
            raise NotReady(self.state.not_ready_reason() or "model is loading")
        return self.state.loaded

    def _authenticate(self, scope: Scope) -> None:
        check_key(next((v for k, v in scope["headers"] if k == b"authorization"), None), self.api_keys)


def check_key(header: bytes | None, api_keys: tuple[bytes, ...]) -> None:
    """``Authorization: Bearer <key>`` (an HTTP header or gRPC metadata) with one of the keys; raises
    Unauthenticated. Never says which part was wrong, never logs the key."""
    if header is None:
        raise Unauthenticated("this server needs an API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <key>'")
    token = token.strip()
    matched = False
    for key in api_keys:  # every key compared, each in constant time
        matched |= hmac.compare_digest(token, key)
    if not matched:
        raise Unauthenticated("invalid API key")


# Async on purpose: FastAPI runs a plain ``def`` dependency in a worker thread, a hop that costs more than the
# rest of a small request's handling (bench/).
async def loaded_state(request: Request) -> LoadedState:
    """The models the guard let this request reach (FastAPI dependency; the fast path reads the same key)."""
    try:
        return request.scope[SCOPE_KEY]
    except KeyError:
        raise RuntimeError(
            f"{request.url.path} uses the models but the guard did not check it: add its prefix to its "
            "protocol's MODEL_PREFIXES"
        ) from None


Loaded = Annotated[LoadedState, Depends(loaded_state)]
