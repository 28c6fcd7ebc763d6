"""The HTTP shape of errors, shared by every layer that answers: ``{"error": "..."}`` with its status."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from service.errors import ServiceError, http_status

log = logging.getLogger("addnorm.service")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one shape of every error the API returns."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def from_error(exc: ServiceError) -> JSONResponse:
    """A domain error as HTTP, through the one table (service.errors.HTTP_STATUS)."""
    headers = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    return error_response(http_status(exc), exc.message, headers)


def unexpected_error(exc: Exception, method: str, path: str) -> JSONResponse:
    """A bug, not the client's fault: log it with its traceback, answer a JSON 500."""
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server log")
