"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a bare 500
for bad input."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvflow")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """Raised by a handler; becomes the OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def _printable(text: str | None) -> str | None:
    """A message may quote the client's input: escape what UTF-8 cannot carry (lone surrogates),
    so that the error itself can always be sent."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": _printable(message), "type": _TYPES.get(status, "server_error"),
                      "param": _printable(param), "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code=None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# Field names that SamplingParams / the engine put at the front of their messages.
_PARAM_RE = re.compile(r"^(n|temperature|top_p|top_k|min_p|presence_penalty|frequency_penalty|"
                       r"repetition_penalty|max_tokens|min_tokens|logprobs|top_logprobs|prompt_logprobs|seed|"
                       r"prompt|messages|stop|stop_token_ids|logit_bias|max_completion_tokens|structured_outputs|"
                       r"response_format|tools|tool_choice)\b")


def bad_request(error: ValueError | str) -> APIError:
    """A 400 from a ValueError raised while checking a request; `param` is the field named first."""
    message = str(error)
    m = _PARAM_RE.match(message)
    return APIError(400, message, param=m.group(1) if m else None, code="invalid_value")


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """`error` from the chat path, naming another API's fields (`names`: chat field -> its
    name there) in its `param` and at the head of its message."""
    if error.param not in names:
        return error
    message = error.message
    if message.startswith(error.param):
        message = names[error.param] + message[len(error.param):]
    return APIError(error.status, message, names[error.param], error.code, error.headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one message and the field named first (OpenAI's `param`)."""
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        if err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON: {err.get('msg')}")
            continue
        field = ".".join(loc)
        # a check over the whole body names its field in the error's context
        param = param or (loc[0] if loc else (err.get("ctx") or {}).get("param"))
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return "; ".join(parts[:5]) or "invalid request", param


def _body_error_message(exc: StarletteHTTPException) -> str | None:
    """FastAPI says only "There was an error parsing the body"; name the cause it hides."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8: {cause}"
    if isinstance(cause, RecursionError):
        return "request body JSON is nested too deeply"
    if cause is not None and exc.status_code == 400:
        return f"request body could not be parsed: {type(cause).__name__}: {cause}"
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        e = bad_request(exc)
        return error_response(400, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, _body_error_message(exc) or str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")
