"""OpenAI-style errors: one exception type, one body shape, and the handlers that turn every failure
(invalid JSON, wrong types, unknown routes, bugs) into it.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``. Invalid
requests are 400 (never FastAPI's 422), as OpenAI answers them; 500 is kept for real bugs, and says nothing
of them but an error id, which the log line with the details carries too.
"""

from __future__ import annotations

import logging
import reprlib
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("lmkit.serve")


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class APIError(Exception):
    """A request the server answers with ``status``, an OpenAI error body and ``headers`` (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


def internal_error(what: str, exc: BaseException | None = None) -> APIError:
    """A 500 for a bug: logs ``what`` (and ``exc``'s traceback) under a new error id; the client gets the id only."""
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s: %s", error_id, what, exc_info=exc)
    return APIError(500, f"The server had an error while processing your request (error id {error_id}); "
                         "its log has the details under that id.")


def _param_name(loc: tuple[Any, ...]) -> str | None:
    """'messages[0].content' from pydantic's ('body', 'messages', 0, 'content', ...); union branch
    names (model or type names) are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and (item[:1].isupper() or "[" in item or item in ("str", "int", "list")):
            continue  # union branch label
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


_SHOW = reprlib.Repr()  # an input shown in a message: short, at a cost that does not grow with it
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlong = 40
_SHOW.maxlist = _SHOW.maxtuple = 6
_SHOW.maxdict = 4


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is one FastAPI parses as JSON (application/json, application/*+json)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """The first problem of a failed validation, as OpenAI words it (``content_type``: the request's header)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                             "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)")
    param = _param_name(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing" and param is None:
        return APIError(400, "the request body is missing: send a JSON object (Content-Type: application/json)")
    if param is None and not _is_json(content_type):  # FastAPI reads such a body as raw bytes
        sent = f"'Content-Type: {content_type}'" if content_type else "no Content-Type header"
        return APIError(400, f"The request body must be a JSON object sent with 'Content-Type: application/json'; "
                             f"this request had {sent}.", None, "invalid_content_type")
    if param is None:  # JSON, but not an object
        return APIError(400, f"The request body must be a JSON object (got {_SHOW.repr(first.get('input'))}).",
                        None, "invalid_type")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    shown = _SHOW.repr(first.get("input"))
    message = first.get("msg", "invalid")
    if kind == "value_error":  # raised by our validators: the text after pydantic's prefix is ours
        message = message.removeprefix("Value error, ")
    return APIError(400, f"Invalid value for '{param}': {message} (got {shown}).", param,
                    "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")


class BodyRefused(StarletteHTTPException):
    """A body that failed its route's validation on the JSON thread (serve/asgi.py); ``error`` is its answer.
    An HTTPException because FastAPI passes those on while it reads a body, where it would make any other
    exception a 400 "There was an error parsing the body"."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves as an OpenAI error body with the right status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return exc.error.response()
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(f"{type(exc).__name__} on {request.method} {request.url.path}", exc).response()
