"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every failure a client can cause or observe becomes an ``APIError``; ``api_error_from`` maps the
async engine's exceptions onto statuses (503 not ready / shutting down, 429 queue full with
Retry-After, 400 a request the engine refuses, 500 an engine failure). A 500's body names an
error id, never the exception's text; the log has the text under that id (``internal_error``).
"""
from __future__ import annotations

import logging
import secrets

from fastapi.responses import JSONResponse

from tandem.errors import EngineError, EngineUnavailable, QueueFull, RequestAbortedByShutdown, RequestFailed
from tandem.kv_transfer import KVTransferFailed, KVTransferReplayed
from tandem.errors import InvalidRequest
from tandem.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("tandem.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client. ``code`` is a short machine-readable reason, also the
    ``reason`` label of ``tandem:request_errors_total``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str = "invalid_request", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def api_error_from(exc: BaseException) -> APIError:
    """The client-facing error of an exception raised while admitting or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="queue_full",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="unavailable")
    if isinstance(exc, RequestAbortedByShutdown):
        return APIError(503, str(exc), code="shutdown")
    if isinstance(exc, KVTransferReplayed):
        return APIError(409, str(exc), param="kv_transfer_params", code="kv_transfer_replayed")
    if isinstance(exc, KVTransferFailed):
        return APIError(502, str(exc), code="kv_transfer_failed")
    if isinstance(exc, RequestFailed):
        return internal_error(exc, "the engine failed this request", "engine_exception")
    if isinstance(exc, EngineError):
        return internal_error(exc, "the engine failed", "engine_error")
    if isinstance(exc, InvalidRequest):  # a subclass may name its own code (grammar_too_complex)
        return APIError(400, f"{exc.param} {exc.detail}", param=exc.param,
                        code=getattr(exc, "code", "invalid_request"))
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return internal_error(exc, "internal error", "internal_error")


def internal_error(exc: BaseException, what: str, code: str) -> APIError:
    """A 500 that names an error id, never the exception's text (it can hold a prompt, a path or
    a key): the text is logged under that id, for the operator."""
    error_id = secrets.token_hex(6)
    logger.error("%s (error id %s): %s: %s", what, error_id, type(exc).__name__, exc,
                 exc_info=exc if exc.__traceback__ is not None else None)
    return APIError(500, f"{what} (error id {error_id}; the server's log has the details)", code=code)
