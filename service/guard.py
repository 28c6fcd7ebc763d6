"""What every request meets before its handler: the one guard, for every transport, and the rest of the HTTP front.

Every HTTP request passes the guard before any route, and every gRPC call before its
method (an interceptor). It lets the health probes through untouched; every other path needs a valid API key when
keys are set (``Authorization: Bearer <key>``, one of them, compared in constant time), and model paths need the
models' manifests read (each handler then answers 503 for a model still loading, 404 for a name no manifest has).
An HTTP route that needs the models gets them from the guard (``Known``), so a model route the guard did not cover
fails loudly instead of serving unguarded; ``tests/service/test_guard.py`` tries every route the app serves and
every gRPC method.

The HTTP front (``service.front.middleware.Front``) and the gRPC server's interceptor both ask it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from typing import Annotated

from fastapi import Depends, Request

from addnorm.service.errors import (
    NotReady,
    Unauthenticated,
)
from addnorm.service.models.state import KnownModels, ServiceState

SCOPE_KEY = "addnorm.known"  # where the guard leaves the KnownModels for the routes past it


class Guard:
    """Decides whether a request may reach its handler, from its path (an HTTP path, or a gRPC method's full
    name such as ``/inference.GRPCInferenceService/ModelInfer``) and the credentials it carries (every value of
    its ``authorization`` header or metadata). The HTTP front (``service.front.middleware.Front``) and the gRPC server's
    interceptor (``grpc_server.GuardInterceptor``) both ask it, so a new check here holds for every transport.

    ``public_paths``: served without checks (health probes); ``model_prefixes``: paths whose handlers use the
    models, refused with 503 until the manifests are read; the API keys are the state's (none = open).
    """

    def __init__(
        self, state: ServiceState, public_paths: frozenset[str], model_prefixes: tuple[str, ...]
    ) -> None:
        self.state = state
        self.public_paths = public_paths
        self.model_prefixes = model_prefixes

    def check(self, path: str, credentials: Callable[[], Sequence[bytes]]) -> KnownModels | None:
        """Raise a ServiceError to refuse the request; return the loaded state for model paths. ``credentials``
        is asked only when keys are set."""
        if path in self.public_paths:
            return None
        if self.state.api_keys:
            check_key(credentials(), self.state.api_keys)
        if not path.startswith(self.model_prefixes):
            return None
        if self.state.known is None:
            raise NotReady(self.state.not_ready_reason() or "model is loading")
        return self.state.known


def check_key(credentials: Sequence[bytes], api_keys: tuple[bytes, ...]) -> None:
    """Exactly one ``Authorization: Bearer <key>`` (an HTTP header or gRPC metadata) with one of the keys; raises
    Unauthenticated. Two credentials are refused whatever they hold, so no transport picks one of them. Never
    says which key part was wrong, never logs the key."""
    if not credentials:
        raise Unauthenticated("this server needs an API key: send 'Authorization: Bearer <key>'")
    if len(credentials) > 1:
        raise Unauthenticated(f"send one Authorization header, not {len(credentials)}")
    scheme, _, token = credentials[0].partition(b" ")
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
async def known_models(request: Request) -> KnownModels:
    """The models the guard let this request reach (FastAPI dependency)."""
    try:
        return request.scope[SCOPE_KEY]
    except KeyError:
        raise RuntimeError(
            f"{request.url.path} uses the models but the guard did not check it: add its prefix to its "
            "protocol's MODEL_PREFIXES"
        ) from None


Known = Annotated[KnownModels, Depends(known_models)]
