"""API errors: one exception type, mapped to ``{"error": "..."}`` with its status code by ``error_response``."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

log = logging.getLogger("addnorm.service")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one shape of every error the API returns."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def unexpected_error(exc: Exception, method: str, path: str) -> JSONResponse:
    """A bug, not the client's fault: log it with its traceback, answer a JSON 500."""
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server log")


class ApiError(Exception):
    """An error the client should see, with its HTTP status."""

    status: int = 400

    def __init__(
        self, message: str, status: int | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400


class NotFound(ApiError):
    status = 404


class PayloadTooLarge(ApiError):
    status = 413


class UnsupportedMediaType(ApiError):
    status = 415


class NotAcceptable(ApiError):
    status = 406


class Overloaded(ApiError):
    status = 429


class Unavailable(ApiError):
    status = 503


class Timeout(ApiError):
    status = 504


class ClientGone(ApiError):
    """The client disconnected before its answer was ready (nginx's 499; nobody reads it)."""

    status = 499

    def __init__(self) -> None:
        super().__init__("client closed the request")
