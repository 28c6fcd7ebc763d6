"""Domain errors: what went wrong with a request, in words a protocol front end can map to its own codes.

The batcher, the engine, the guard and the codecs raise these, knowing no transport; ``CODES`` is the one table
that turns them into each transport's status: an HTTP status and a gRPC status code name. Their HTTP shape, shared
by every layer that answers, is here too (``from_error``): an API's own error body (``ErrorShape``; ``plain``:
``{"error": "..."}``) with its status.
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Callable

from starlette.responses import JSONResponse

MAX_MESSAGE = 1024
_REPR = reprlib.Repr()  # (keyword arguments need Python 3.12)
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxlong = 2, 8, 8, 60
_REPR.maxstring = _REPR.maxother = 200


def quote(value: object, limit: int = 40) -> str:
    """A client's value (a name, a version, a header, a field) in an error message: its literal, cut past
    ``limit`` characters with a marker. Bounded in cost too: a megabyte string or a million-item list is never
    written out whole (reprlib), and no object's internals are: only literals come from a parsed request."""
    if value is None or isinstance(value, bool):  # as the client wrote it: JSON's literals
        return "null" if value is None else "true" if value else "false"
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...(cut)"


def bounded(message: str) -> str:
    """``message`` cut in the middle, with a marker, to at most ``MAX_MESSAGE`` characters."""
    if len(message) <= MAX_MESSAGE:
        return message
    cut = len(message) - MAX_MESSAGE + 40
    return f"{message[: MAX_MESSAGE // 2]}...({cut} characters cut)...{message[-(MAX_MESSAGE // 2 - 40) :]}"


class ServiceError(Exception):
    """A request the service refused or could not answer. ``retry_after``: seconds a client should wait.
    ``message`` is what the client reads: at most ``MAX_MESSAGE`` characters, whatever was quoted into it."""

    retry_after: int | None = None

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        message = bounded(message)
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
    """The queue is full: ``Overloaded.by(what)`` says by what."""

    retry_after = 1

    @classmethod
    def by(cls, what: str) -> Overloaded:
        return cls(f"server is at capacity ({what}); retry shortly")


class NotReady(ServiceError):
    """The model is still loading, or failed to load."""

    retry_after = 1


class ShuttingDown(ServiceError):
    """The server is stopping and takes no more work."""


class TimedOut(ServiceError):
    """The request was not answered within its deadline."""


class ClientDeadline(TimedOut):
    """The request's own deadline (V2's ``timeout`` parameter, a gRPC call's deadline), shorter than the server's,
    passed before it was answered: the client's choice, so a 4xx over HTTP."""


class BodyTimeout(ServiceError):
    """The request's body did not arrive within the server's body deadline (ADDNORM_BODY_TIMEOUT_S)."""


class InferenceFailed(ServiceError):
    """The model run failed; not the client's fault."""


class ControlOff(ServiceError):
    """Model control is not enabled on this server, or not for this operation (service/models/state.py)."""


class LoadRefused(ServiceError):
    """A model, or its new version, could not be loaded; what serves the name is unchanged."""


class ClientGone(ServiceError):
    """The client disconnected before its answer was ready (nobody reads the answer)."""

    def __init__(self) -> None:
        super().__init__("client closed the request")


# error class -> (HTTP status, gRPC status code name)
CODES: dict[type[ServiceError], tuple[int, str]] = {
    BadInput: (400, "INVALID_ARGUMENT"),
    Unauthenticated: (401, "UNAUTHENTICATED"),
    NotFound: (404, "NOT_FOUND"),
    NotAcceptable: (406, "INVALID_ARGUMENT"),
    TooLarge: (413, "RESOURCE_EXHAUSTED"),  # what gRPC itself answers for a message above its limit
    UnsupportedMediaType: (415, "INVALID_ARGUMENT"),
    Overloaded: (429, "RESOURCE_EXHAUSTED"),
    ClientGone: (499, "CANCELLED"),  # 499: nginx's code for it
    InferenceFailed: (500, "INTERNAL"),
    NotReady: (503, "UNAVAILABLE"),
    ShuttingDown: (503, "UNAVAILABLE"),
    TimedOut: (504, "DEADLINE_EXCEEDED"),
    ClientDeadline: (408, "DEADLINE_EXCEEDED"),
    BodyTimeout: (408, "DEADLINE_EXCEEDED"),
    ControlOff: (400, "FAILED_PRECONDITION"),  # Triton answers a load it does not allow with a 400
    LoadRefused: (400, "FAILED_PRECONDITION"),
}


def _codes(exc: ServiceError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return 500, "INTERNAL"


def http_status(exc: ServiceError) -> int:
    """The HTTP status of a domain error (its nearest class in the table)."""
    return _codes(exc)[0]


def grpc_code(exc: ServiceError) -> str:
    """The gRPC status code name (``grpc.StatusCode[name]``) of a domain error."""
    return _codes(exc)[1]


log = logging.getLogger("addnorm.service")


# An API's error body from a status and its message: each API answers in its own shape (OpenAI's error object,
# TEI's {error, error_type}); the protocols say which path speaks which (protocols.error_shape).
ErrorShape = Callable[[int, str], dict]


def plain(status: int, message: str) -> dict:
    """``{"error": message}``: /v1's, V2's (the Open Inference Protocol's own) and every path of no API's own."""
    return {"error": message}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, shape: ErrorShape = plain
) -> JSONResponse:
    """An error answer in ``shape`` (its message bounded, as a domain error's is)."""
    return JSONResponse(shape(status, bounded(message)), status_code=status, headers=headers)


def from_error(exc: ServiceError, shape: ErrorShape = plain) -> JSONResponse:
    """A domain error as HTTP, through the one table (service.errors.CODES), in ``shape``."""
    status = http_status(exc)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if status == 401:  # RFC 9110: a 401 says how to authenticate
        headers["WWW-Authenticate"] = 'Bearer realm="addnorm"'
    return error_response(status, exc.message, headers or None, shape)


def unexpected_error(exc: Exception, method: str, path: str, shape: ErrorShape = plain) -> JSONResponse:
    """A bug, not the client's fault: log it with its traceback, answer a JSON 500."""
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server log", shape=shape)
