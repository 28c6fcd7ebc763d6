"""The protocols the server speaks, gathered in one place. Each HTTP protocol is a module (or package) with a
FastAPI ``router``; a transport with its own listener (gRPC)
has ``listen(state, guard)``, which the app's lifespan awaits; every way in names the ``MODEL_PREFIXES`` the guard must
check for readiness and the ``PUBLIC_PATHS`` (health probes) it lets through; an API with an error shape of its own
names its ``ERROR_PATHS`` and ``error_shape``.
Adding a protocol is one line here. Inference routes come first: the router tries routes in order.
"""

from addnorm.service.errors import ErrorShape, plain
from addnorm.service.protocols import health
from addnorm.service.protocols.text import cohere, openai, rerank, tei, vllm
from addnorm.service.protocols.v1 import routes as v1
from addnorm.service.protocols.v2 import grpc_server
from addnorm.service.protocols.v2 import routes as v2

# over HTTP, in the order the router tries them: the text APIs (the front door) first, then /v1's two routes,
# its inference route ahead of V2's many (each route tried before a request's costs it ~1.5 us of the event loop);
# vLLM's routes after them (their paths are no other's: they cost the hot routes nothing)
PROTOCOLS = (openai, tei, rerank, cohere, v1, v2, vllm, health)
LISTENERS = (
    grpc_server,
)  # with a listener of their own: ``await listen(state, guard)`` -> None or ``.stop(grace)``
TRANSPORTS = (*PROTOCOLS, *LISTENERS)  # every way in, for the one guard

ROUTERS = tuple(p.router for p in PROTOCOLS)
# The paths whose errors a protocol answers in its API's own shape (``ERROR_PATHS``, ``error_shape``), longest first;
# every other path answers {"error": ...} (errors.plain).
ERROR_SHAPES = tuple(
    sorted(
        ((path, p.error_shape) for p in PROTOCOLS if hasattr(p, "ERROR_PATHS") for path in p.ERROR_PATHS),
        key=lambda entry: -len(entry[0]),
    )
)
MODEL_PREFIXES = tuple(prefix for p in TRANSPORTS for prefix in p.MODEL_PREFIXES)
PUBLIC_PATHS = frozenset(path for p in TRANSPORTS for path in p.PUBLIC_PATHS)


def error_shape(path: str) -> ErrorShape:
    """The error shape of the API that serves ``path``."""
    for prefix, shape in ERROR_SHAPES:
        if path.startswith(prefix):
            return shape
    return plain


def examples(model: str, d_model: int) -> dict[tuple[str, str], dict]:
    """Every protocol's request examples for a served model, by (OpenAPI path, method) (service/protocols/docs.py)."""
    return {
        key: value
        for p in PROTOCOLS
        if hasattr(p, "examples")
        for key, value in p.examples(model, d_model).items()
    }
