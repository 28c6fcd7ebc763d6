"""Domain errors: what went wrong with a request, in words a protocol front end can map to its own codes.

Nothing here knows HTTP. The batcher, the engine, the guard and the codecs raise these; ``HTTP_STATUS`` is the one
table that turns them into status codes (a gRPC front end adds its column beside it).
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refused or could not answer. ``retry_after``: seconds a client should wait."""

    retry_after: int | None = None

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after is not None:
            self.retry_after = retry_after


class BadInput(ServiceError):
    """The request is malformed or does not fit the model."""


class Unauthenticated(ServiceError):
    """No valid API key."""


class NotFound(ServiceError):
    """No such model, version or output."""


class TooLarge(ServiceError):
    """The request is above a size limit."""


class UnsupportedMediaType(ServiceError):
    """The body's media type or encoding is not one the protocol reads."""


class NotAcceptable(ServiceError):
    """The client accepts no media type the protocol writes."""


class Overloaded(ServiceError):
    """The queue is full."""

    retry_after = 1


class NotReady(ServiceError):
    """The model is still loading, or failed to load."""

    retry_after = 1


class ShuttingDown(ServiceError):
    """The server is stopping and takes no more work."""


class TimedOut(ServiceError):
    """The request was not answered within its deadline."""


class InferenceFailed(ServiceError):
    """The model run failed; not the client's fault."""


class ClientGone(ServiceError):
    """The client disconnected before its answer was ready (nobody reads the answer)."""

    def __init__(self) -> None:
        super().__init__("client closed the request")


HTTP_STATUS: dict[type[ServiceError], int] = {
    BadInput: 400,
    Unauthenticated: 401,
    NotFound: 404,
    NotAcceptable: 406,
    TooLarge: 413,
    UnsupportedMediaType: 415,
    Overloaded: 429,
    ClientGone: 499,  # nginx's code for it
    InferenceFailed: 500,
    NotReady: 503,
    ShuttingDown: 503,
    TimedOut: 504,
}


def http_status(exc: ServiceError) -> int:
    """The HTTP status of a domain error (its nearest class in the table)."""
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500
