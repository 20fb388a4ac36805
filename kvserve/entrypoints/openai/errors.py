"""Every error as OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: ``OpenAIError``, the exception
handlers of the app (``add_exception_handlers``) and the mapping of pydantic's validation errors to one 400 naming the field
(``validation_error``, ``field_path``).

Status codes: 400 for bad input (bad JSON, unknown model, invalid or unsupported parameter, prompt too long, a bound
of ``limits.RequestLimits``), 401 for a missing or wrong API key, 404 for an unknown route, 405 for a wrong method,
413 for a body over ``--max-request-body-bytes``, 503 while shutting down; 500 only for a server bug.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.entrypoints.openai import protocol as p

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered with ``{"error": {"message", "type", "param", "code"}}`` and ``status`` (400 by default)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code=None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers  # sent with the answer (a 503's Retry-After)

    def body(self) -> dict:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump()


class AsciiJSONResponse(JSONResponse):
    """A body as ASCII JSON: it may quote client text, which can hold a lone surrogate (valid in JSON, not
    encodable as UTF-8); escaped, it can never turn an answer into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


ErrorJSONResponse = AsciiJSONResponse  # an error body (a message may quote client text)


#: Routes whose errors take Anthropic's shape (``anthropic_body``).
ANTHROPIC_PREFIX = "/v1/messages"

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_body(e: OpenAIError) -> dict:
    """``e`` in Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}`` (the type from the
    status: ``invalid_request_error``, ``authentication_error``, ``not_found_error``, ``request_too_large``,
    ``overloaded_error``, else ``api_error``)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: OpenAIError, headers: Optional[dict] = None, path: str = "") -> ErrorJSONResponse:
    """The HTTP response of ``e``: its body with status ``e.status``, ``e.headers`` and ``headers``; on a route
    under ``ANTHROPIC_PREFIX`` (``path``) in Anthropic's shape."""
    body = anthropic_body(e) if path.startswith(ANTHROPIC_PREFIX) else e.body()
    return ErrorJSONResponse(body, status_code=e.status, headers={**(e.headers or {}), **(headers or {})})


def add_exception_handlers(app: FastAPI) -> None:
    """Answer ``OpenAIError`` with its own status, validation failures with a 400 (``validation_error``),
    Starlette's HTTP errors (404, 405) with their status, and anything else with a logged 500."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e, request.headers.get("content-type")), path=request.url.path)

    @app.exception_handler(ValidationError)
    async def _model_validation_error(request: Request, e: ValidationError):  # a body validated in a handler
        err = validation_error(RequestValidationError(e.errors()), request.headers.get("content-type"))
        return error_response(err, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{e.detail}: {request.method} {request.url.path}"
        return error_response(OpenAIError(message, status=e.status_code, type=kind), getattr(e, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = OpenAIError(f"internal server error: {type(e).__name__}", status=500, type="internal_server_error")
        return error_response(err, path=request.url.path)


def unrecognized_argument(param: str) -> OpenAIError:
    """The 400 of a field the request may not have (pydantic's ``extra="forbid"``, and ``check_fields`` for
    payloads checked by hand): ``unrecognized request argument: <param>``, ``param`` the full path."""
    return OpenAIError(f"unrecognized request argument: {param}", param=param, code="unrecognized_argument")


def check_fields(obj: dict, allowed, where: str) -> None:
    """``extra="forbid"`` for a JSON object checked by hand (a Responses input item, an Anthropic content block or
    tool): every key of ``obj`` must be in ``allowed``.

    Raises:
        OpenAIError: 400 ``unrecognized_argument`` naming ``<where>.<key>`` (the first unknown key, sorted).
    """
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise unrecognized_argument(f"{where}.{extra[0]}")


_UNION_HINTS = {  # by the field's last name
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {'role': str, 'content': str or a list of text parts} objects",
    "content": "a string or a list of {'type': 'text', 'text': str} parts (null only in an assistant message)",
}
_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def field_path(loc) -> str:
    """pydantic's error location as the field path kvserve's messages use (``messages[0].content``,
    ``tools[0].function.name``), cut before the first union-member tag (``str``, ``list[ContentPart]``, ...)."""
    path = ""
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x in _SCALAR_TAGS or not str(x).isidentifier():
            break
        else:
            path += f".{x}" if path else str(x)
    return path


def content_type_hint(content_type: Optional[str]) -> str:
    """``""`` for a JSON ``Content-Type``, else a hint to send one (naming what the request sent)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return ""
    return (f"; send a JSON object with the header Content-Type: application/json (this request has "
            f"{'no Content-Type' if not media else 'Content-Type: ' + media})")


def validation_error(e: RequestValidationError, content_type: Optional[str] = None) -> OpenAIError:
    """One 400 ``OpenAIError`` from pydantic's errors: the first offending top-level field as ``param``; a body
    that is not a JSON object sent without ``Content-Type: application/json`` says so."""
    errors = e.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    kind = first.get("type")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    hint = content_type_hint(content_type)
    if kind == "json_invalid":
        return OpenAIError(f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}{hint}",
                           code="json_invalid")
    if kind == "string_unicode":  # a lone surrogate where pydantic needs a real string (an object key)
        return OpenAIError("the request body holds a string that is not valid Unicode text (a lone surrogate)",
                           param=str(loc[0]) if loc else None)
    if not loc:
        return OpenAIError(f"the request body must be a JSON object ({first.get('msg')}){hint}")
    param = field_path(loc)
    if kind == "extra_forbidden":
        return unrecognized_argument(param)
    if kind == "missing":
        return OpenAIError(f"{param}: a required field is missing", param=param)
    same_field = [err for err in errors if field_path([x for x in err.get("loc", ()) if x != "body"]) == param]
    leaf = param.rsplit(".", 1)[-1].split("[")[0]
    if len(same_field) > 1 and leaf in _UNION_HINTS:
        return OpenAIError(f"{param} must be {_UNION_HINTS[leaf]}", param=param)
    return OpenAIError(f"{param}: {first.get('msg')}", param=param)
