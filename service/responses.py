"""The HTTP shape of errors, shared by every layer that answers: ``{"error": "..."}`` with its status."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from service.errors import ServiceError, bounded, http_status

log = logging.getLogger("addnorm.service")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one shape of every error the API returns (its message bounded, as a domain error's is)."""
    return JSONResponse({"error": bounded(message)}, status_code=status, headers=headers)


def from_error(exc: ServiceError) -> JSONResponse:
    """A domain error as HTTP, through the one table (service.errors.CODES)."""
    status = http_status(exc)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if status == 401:  # RFC 9110: a 401 says how to authenticate
        headers["WWW-Authenticate"] = 'Bearer realm="addnorm"'
    if (
        status == 413
    ):  # the refused body may still be on its way: don't read it, close the connection after this
        headers["Connection"] = "close"
    return error_response(status, exc.message, headers or None)


def unexpected_error(exc: Exception, method: str, path: str) -> JSONResponse:
    """A bug, not the client's fault: log it with its traceback, answer a JSON 500."""
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server log")
