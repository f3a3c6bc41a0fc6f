"""Anthropic-shaped errors, `{"type": "error", "error": {"type", "message"}}`, for every route
of the Messages API: `AnthropicRoute` turns what the shared code raises (OpenAI-shaped
APIError, pydantic's validation errors, the engine's errors) into that shape."""
from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.core_client import EngineDeadError
from kvflow.entrypoints.openai.errors import (APIError, _body_error_message, _printable,
                                             bad_request, validation_message)
from kvflow.entrypoints.openai.serving_engine import ShuttingDownError

logger = logging.getLogger("kvflow")

# HTTP status -> Anthropic's error type
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """The error body; the field at fault leads the message (Anthropic has no `param`)."""
    message = _printable(message) or "error"
    if param and not message.startswith(param):
        message = f"{_printable(param)}: {message}"
    return {"type": "error", "error": {"type": TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_response(status: int, message: str, param: str | None = None,
                             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message, param), status_code=status,
                        headers=headers)


def as_anthropic(e: BaseException) -> tuple[int, str, str | None]:
    """(status, message, field) of an error raised while serving a request."""
    if isinstance(e, APIError):
        return e.status, e.message, e.param
    if isinstance(e, RequestValidationError):
        message, param = validation_message(e.errors())
        return 400, message, param
    if isinstance(e, ValueError):
        err = bad_request(e)
        return 400, err.message, err.param
    if isinstance(e, ShuttingDownError):
        return 503, str(e), None
    if isinstance(e, EngineDeadError):
        return 503, f"the engine is not running: {e}", None
    if isinstance(e, StarletteHTTPException):
        return e.status_code, _body_error_message(e) or str(e.detail), None
    return 500, f"internal server error: {type(e).__name__}", None


class AnthropicRoute(APIRoute):
    """A route whose every error, the body's validation included, is Anthropic-shaped."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request):
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001 - every error leaves in the API's own shape
                status, message, param = as_anthropic(e)
                if status == 500:
                    logger.exception("internal error on %s", request.url.path)
                return anthropic_error_response(status, message, param,
                                                getattr(e, "headers", None))
        return route
