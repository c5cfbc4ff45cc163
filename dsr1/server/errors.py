"""OpenAI-style errors: every failure the server answers is `{"error": {"message", "type", "param",
"code"}}` with a fitting HTTP status, as OpenAI's API (and the clients written for it) expect.

`APIError` is raised anywhere below a route; `install_error_handlers` turns it, Starlette's own
HTTP errors (unknown path, wrong method) and anything unexpected into that shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "error_response", "install_error_handlers"]

log = logging.getLogger("dsr1.server")

# OpenAI's error types by status (the `type` field); `code` is more specific and optional.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the server answers with an error: HTTP `status`, a message for humans, the
    request field at fault (`param`), a machine-readable `code`, and extra response headers
    (e.g. `Retry-After`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")


def error_body(error: APIError) -> dict[str, Any]:
    """The JSON body of an error response."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_response(error: APIError) -> JSONResponse:
    """`error` as a response (status, body and headers)."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else "method_not_allowed" if error.status_code == 405 else None
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(APIError(error.status_code, message, code=code, headers=dict(error.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # Routes parse their own bodies (`protocol.parse_request`); this only covers path and query parameters.
        first = error.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        return error_response(APIError(400, f"invalid value for '{param}': {first.get('msg')}", param=param,
                                       code="invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(error).__name__}: {error}",
                                       code="internal_error"))
