"""Errors the router answers itself, in OpenAI's shape ``{"error": {message, type, param, code}}``
(the instances' own errors pass through unchanged)."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    500: "internal_server_error",
    502: "service_unavailable_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class RouterError(Exception):
    """An error the router answers with ``status``; ``code`` is a short machine-readable reason."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as one server-sent event, for a stream that already started."""
        return f"data: {json.dumps(self.body())}\n\n"
