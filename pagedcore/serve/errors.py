"""Errors of the serve layer, each with the HTTP status and OpenAI error fields it maps to."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "EngineDeadError",
    "NotFoundError",
    "PayloadTooLargeError",
    "QueueFullError",
    "RequestFailedError",
    "ServeError",
    "ShuttingDownError",
    "error_body",
]


class ServeError(Exception):
    """A request the server answers with an OpenAI-style error.

    Attributes
    ----------
    status:
        HTTP status code.
    type, code, param:
        The fields of OpenAI's ``{"error": {...}}`` object (``param`` names the request field
        at fault, or None).
    headers:
        Extra response headers (``Retry-After`` for retryable refusals).
    """

    status = 500
    type = "internal_server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})


class BadRequestError(ServeError):
    """The request cannot be served as given (HTTP 400)."""

    status = 400
    type = "invalid_request_error"


class NotFoundError(ServeError):
    """An unknown model or route (HTTP 404)."""

    status = 404
    type = "not_found_error"


class AuthenticationError(ServeError):
    """A missing or wrong API key (HTTP 401)."""

    status = 401
    type = "authentication_error"


class PayloadTooLargeError(ServeError):
    """The request body is larger than the server accepts (HTTP 413)."""

    status = 413
    type = "invalid_request_error"


class QueueFullError(ServeError):
    """Admission control refused the request; retry after `retry_after` seconds (HTTP 503)."""

    status = 503
    type = "server_overloaded"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, code="queue_full", headers={"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class ShuttingDownError(ServeError):
    """The server is shutting down and admits nothing new (HTTP 503)."""

    status = 503
    type = "server_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="shutting_down", headers={"Retry-After": "5"})


class EngineDeadError(ServeError):
    """The engine loop stopped after an unrecoverable failure (HTTP 503, not retryable here)."""

    status = 503
    type = "server_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="engine_dead")


class RequestFailedError(ServeError):
    """The engine step computing this request failed; other requests are unaffected (500)."""

    status = 500
    type = "internal_server_error"


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
