"""The protocols the server speaks, gathered in one place. Each HTTP protocol is a module (or package) with a
FastAPI ``router``; a transport with its own listener (gRPC)
has ``listen(state, guard)``, which the app's lifespan awaits; every way in names the ``MODEL_PREFIXES`` the guard must
check for readiness and the ``PUBLIC_PATHS`` (health probes) it lets through.
Adding a protocol is one line here. Inference routes come first: the router tries routes in order.
"""

from addnorm.service.protocols import health
from addnorm.service.protocols.text import openai, tei
from addnorm.service.protocols.v1 import routes as v1
from addnorm.service.protocols.v2 import grpc_server
from addnorm.service.protocols.v2 import routes as v2

# over HTTP, in the order the router tries them: the text APIs (the front door) first, then /v1's two routes,
# its inference route ahead of V2's many (each route tried before a request's costs it ~1.5 us of the event loop)
PROTOCOLS = (openai, tei, v1, v2, health)
LISTENERS = (
    grpc_server,
)  # with a listener of their own: ``await listen(state, guard)`` -> None or ``.stop(grace)``
TRANSPORTS = (*PROTOCOLS, *LISTENERS)  # every way in, for the one guard

ROUTERS = tuple(p.router for p in PROTOCOLS)
MODEL_PREFIXES = tuple(prefix for p in TRANSPORTS for prefix in p.MODEL_PREFIXES)
PUBLIC_PATHS = frozenset(path for p in TRANSPORTS for path in p.PUBLIC_PATHS)


def examples(model: str, d_model: int) -> dict[tuple[str, str], dict]:
    """Every protocol's request examples for a served model, by (OpenAPI path, method) (service/protocols/docs.py)."""
    return {
        key: value
        for p in PROTOCOLS
        if hasattr(p, "examples")
        for key, value in p.examples(model, d_model).items()
    }
