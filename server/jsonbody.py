"""Strict JSON request bodies: what `json.loads` lets through but no client may send.

Python's parser accepts NaN / Infinity literals, lone UTF-16 surrogates
(`"\\ud800"`, which no UTF-8 encoder can write back, so any echo of them in a
response or a log fails) and nesting deep enough to exhaust the interpreter's
recursion limit. Each is refused here, before pydantic sees the body, as a
`json.JSONDecodeError`, which FastAPI turns into a validation error and
`server.errors` into a 400 naming the problem.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

MAX_DEPTH = 64  # far beyond any OpenAI request (chat content parts nest ~5 deep)
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyRejected(json.JSONDecodeError):
    """A body that parses as Python's JSON but is not one a client may send."""

    def __init__(self, reason: str, doc: str = "", pos: int = 0):
        super().__init__(reason, doc, pos)
        self.reason = reason


def _no_constant(name: str) -> Any:
    raise BodyRejected(f"{name} is not valid JSON (numbers must be finite)")


def loads(body: bytes) -> Any:
    """Parse a request body as strict JSON (RFC 8259) or raise BodyRejected."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyRejected(f"body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BodyRejected(f"JSON nesting is deeper than {MAX_DEPTH} levels") from None
    check(value)
    return value


def check(value: Any) -> None:
    """Refuse lone surrogates in any string or key, non-finite floats and deep nesting."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, float) and (item != item or item in (float("inf"), -float("inf"))):
            raise BodyRejected("numbers must be finite (got an overflowing literal)")
        elif isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise BodyRejected(f"JSON nesting is deeper than {MAX_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    match = _SURROGATE.search(text)
    if match is not None:
        raise BodyRejected(
            f"strings must be valid Unicode: lone surrogate \\u{ord(match.group()):04x} "
            f"at character {match.start()}"
        )


class StrictJSONRequest(Request):
    """A Request whose `.json()` is `loads` (FastAPI reads JSON bodies through it)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute that parses its body with `loads`."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
