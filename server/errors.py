"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a 422.

Handlers raise `APIError`; the exception handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors and anything unexpected into that shape. Bodies
never carry a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> Response:
        return Response(
            self.encoded(),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )

    def encoded(self) -> bytes:
        """The body as ASCII JSON: rendering an error never fails, whatever text it echoes."""
        return json.dumps(self.body(), ensure_ascii=True).encode("ascii")


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "function", "literal", "union")


def _loc_to_param(loc: Sequence[Any]) -> tuple[str | None, str]:
    """(top-level field, readable path) of a pydantic error location; union tags dropped."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    if not parts:
        return None, ""
    kept = [
        str(p)
        for p in parts
        if not (isinstance(p, str) and (p.split("[")[0] in _TYPE_TAGS or "[" in p))
    ]
    return str(parts[0]), ".".join(kept)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field; JSON syntax errors say so."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        message = "request body is not valid JSON" + (f": {reason}" if reason else "")
        return bad_request(message, code="invalid_json")
    param, path = _loc_to_param(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "request body must be a JSON object"
    elif param == "prompt" and path == "prompt" and first.get("type") != "value_error":
        message = "must be a string, a list of strings, a list of token ids or a list of lists"
    text = f"{path}: {message}" if path else message
    return bad_request(text, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "route not found"
        headers = dict(exc.headers or {})
        return APIError(exc.status_code, message, headers=headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error while serving a request")
        return APIError(500, "internal server error", code="internal_error").response()
