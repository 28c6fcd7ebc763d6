"""API errors: one exception type, mapped to ``{"error": "..."}`` with its status code by ``error_response``."""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one shape of every error the API returns."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


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
