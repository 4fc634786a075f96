"""API errors: every error the service answers is OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the right status. Request validation
errors become 400 naming the field (never FastAPI's default 422); errors the engine or the
history planner raise for a request map to 400; nothing a client sends produces a 500.

Retry hints as the official SDK reads them: `x-should-retry: false` on 4xx other than 409 and
429; `Retry-After` on 429 and 503."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")
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
        headers = dict(self.headers)
        if 400 <= self.status < 500 and self.status not in (409, 429):
            headers.setdefault("x-should-retry", "false")
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_api_key() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'; "
        "`kvchat keys create` makes one.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def request_too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"The request body is larger than {max_bytes} bytes.", code="request_too_large"
    )


def not_found(what: str, param: str | None = None) -> APIError:
    return APIError(404, f"{what} not found", param=param, code="not_found")


def busy(message: str) -> APIError:
    return APIError(409, message, code="conversation_busy")


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(
        503, message, code="service_unavailable", headers={"Retry-After": str(retry_after)}
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    """A validation error's location as OpenAI names params: `messages.0.role`."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def _validation_message(error: dict[str, Any]) -> str:
    param = _param(tuple(error.get("loc", ())))
    kind = error.get("type", "")
    if kind == "json_invalid":
        return "The request body is not valid JSON."
    if kind in ("model_attributes_type", "dict_type") and param is None:
        return "The request body must be a JSON object."
    message = str(error.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return f"Invalid value for '{param}': {message}" if param else message


def conversation_gone(conversation_id: str) -> APIError:
    """The conversation was deleted (before or during the turn)."""
    return APIError(
        404, f"conversation {conversation_id!r} not found", code="conversation_not_found"
    )


def engine_failure(exc: BaseException) -> APIError:
    """A generation that failed after it started streaming (its client already has a 200)."""
    return APIError(500, f"The generation failed: {exc}", code="engine_error")


def api_error(exc: BaseException) -> APIError:
    """The API error a request's failure is answered with: HTTP responses, SSE error chunks
    and WebSocket error frames all come from here. What a client caused is a 4xx naming the
    field; an engine that is not running is 503; anything unknown is a logged 500."""
    from kvchat.app.store import StaleFence
    from kvchat.history import ContextLengthExceeded, HistoryPolicyError, InvalidHistoryError
    from kvchat.inference import (
        ChatTemplateError,
        EngineDeadError,
        InvalidRequestError,
        RequestFailedError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = "messages" if exc.code == "context_length_exceeded" else exc.field
        return invalid_request(str(exc), param, exc.code)
    if isinstance(exc, ContextLengthExceeded):
        return invalid_request(str(exc), exc.param, exc.code)
    if isinstance(exc, InvalidHistoryError | HistoryPolicyError):
        return invalid_request(str(exc), exc.field)
    if isinstance(exc, ChatTemplateError):
        return invalid_request(str(exc), "messages")
    if isinstance(exc, RequestFailedError):  # logged where the step failed
        return engine_failure(exc)
    if isinstance(exc, EngineDeadError):
        log.error("request refused: %s", exc)
        return unavailable("The engine is not running; try again shortly.", 5)
    if isinstance(exc, StaleFence):
        return busy("Another turn took this conversation over; try again.")
    log.error("unexpected error", exc_info=exc)
    return APIError(
        500, "The server had an error while processing your request.", code="internal_error"
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            param = None
        return invalid_request(_validation_message(first), param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    async def known_error(_: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    # The types api_error knows are answered here; anything else reaches the last handler
    # (Starlette's server-error middleware: the 500 body, the traceback logged once).
    for kind in known_error_types():
        app.add_exception_handler(kind, known_error)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()


def known_error_types() -> tuple[type[Exception], ...]:
    from kvchat.app.store import StaleFence
    from kvchat.history import ContextLengthExceeded, HistoryPolicyError, InvalidHistoryError
    from kvchat.inference import (
        ChatTemplateError,
        EngineDeadError,
        InvalidRequestError,
        RequestFailedError,
    )

    return (
        APIError,
        InvalidRequestError,
        ContextLengthExceeded,
        InvalidHistoryError,
        HistoryPolicyError,
        ChatTemplateError,
        EngineDeadError,
        RequestFailedError,
        StaleFence,
    )
