"""API errors: one exception type, mapped to ``{"error": "..."}`` with its status code in one place (app.py)."""

from __future__ import annotations


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
