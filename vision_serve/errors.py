"""Every failure leaves the server as OpenAI's error body: ``{"error": {message, type, param,
code}}``.

OpenAI SDKs turn that body into typed exceptions (``BadRequestError``, ``RateLimitError`` ...)
keyed on the status, and read ``code``/``param`` from it, so clients can act on our errors
without knowing they talk to us. Unexpected exceptions become a bare 500: the traceback goes to
the log, never to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
)

logger = logging.getLogger("vision_serve.errors")

# Status for a request whose own deadline (``max_queue_seconds``) passed before its prefill
# started: 408 Request Timeout, a 4xx because the outcome follows from what the client asked
# (a server error would page whoever watches 5xx rates, and fuzzing a tiny deadline would
# count as a server failure). The SDK retries 408, so the response also carries
# ``x-should-retry: false``: a stale camera frame should not be re-sent; the caller decides.
EXPIRED_STATUS = 408

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error with everything needed to render OpenAI's error body and status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def expired_error(request_id: str) -> APIError:
    return APIError(
        EXPIRED_STATUS,
        f"request {request_id} expired: its deadline passed before it was scheduled",
        type="timeout_error",
        code="expired",
        headers={"x-should-retry": "false"},
    )


def from_engine_error(exc: Exception) -> APIError:
    """Map the engine's exception family onto HTTP statuses."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(
            400, str(exc), param=exc.param or "messages", code="context_length_exceeded"
        )
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        # 429 rather than 503: the client is asked to slow down; SDKs back off and retry.
        return APIError(
            429,
            str(exc) or "the server's request queue is full",
            code="queue_full",
            headers={"retry-after": "1"},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    return APIError(500, "internal server error", code="internal_error")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"`` (OpenAI's spelling)."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or "-" in str(part):  # pydantic union tags: not a field
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    """Render every error path as OpenAI's body, including FastAPI's own 404/405/422."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_from_loc(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        message = f"{param}: {msg}" if param else msg
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(
            exc.status_code, str(exc.detail), headers=dict(exc.headers or {})
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, InvalidRequestError | QueueFullError | EngineDeadError):
            return from_engine_error(exc).response()
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()
