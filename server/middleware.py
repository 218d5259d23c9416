"""ASGI middleware: request ids and access logs, API key, body size and time limits.

Pure ASGI (no BaseHTTPMiddleware) so streamed responses pass through
untouched and the access log is written when the last byte has gone out.
Order, outermost first: RequestLog (sees every response), ApiKey (refuses a
stranger before a byte of the body is read), BodyLimit (reads the body).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.generation import RequestLog

logger = logging.getLogger("server.access")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
LOGGED_PATH_CHARS = 512  # a longer path is cut in the access log (the formatter escapes it)
CLIENT_CLOSED = 499  # nginx's status for "the client went away before the response ended"
_CLOSE = [(b"connection", b"close")]


async def _send_error(send: Send, error: APIError, extra_headers: list | None = None) -> None:
    """An OpenAI error body; with `connection: close` in `extra_headers` the server then
    hangs up instead of reading (and discarding) a body nobody wants."""
    body = json.dumps(error.body()).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": headers + (extra_headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestLogMiddleware:
    """Takes X-Request-Id from the request (or makes one), returns it, logs one line per request.

    A request whose client disconnected before the response's last byte is logged with
    status 499, whatever status its response had started with (a cut stream too).
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["generation_log"] = log = RequestLog()
        status = 500
        first_byte: float | None = None
        completed = False  # the response's last body message has been sent
        client_gone = False  # the client disconnected before that

        async def receive_watching() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect" and not completed:
                client_gone = True
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, first_byte, completed
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
                first_byte = time.monotonic()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True

        try:
            await self.app(scope, receive_watching, send_with_id)
        finally:
            path = scope.get("path", "")
            if path not in OPEN_PATHS:
                fields: dict[str, Any] = {
                    "request_id": request_id,
                    "method": scope.get("method"),
                    "path": path[:LOGGED_PATH_CHARS],
                    "status": CLIENT_CLOSED if client_gone else status,
                    "duration_s": round(time.monotonic() - started, 4),
                }
                if log.prompt_tokens:
                    fields["prompt_tokens"] = log.prompt_tokens
                    fields["completion_tokens"] = log.completion_tokens
                    fields["ttft_s"] = None if log.ttft_s is None else round(log.ttft_s, 4)
                    fields["finish_reasons"] = log.finish_reasons
                if log.error:
                    fields["error"] = log.error
                if first_byte is not None:
                    fields["headers_s"] = round(first_byte - started, 4)
                logger.info("request", extra=fields)


class BodyLimitMiddleware:
    """Reads a request body up to `max_bytes` within `read_timeout_s` of the headers.

    Larger is a 400 naming the limit, slower a 408; both close the connection, so
    the rest of the body is never read. A body that drips in a byte at a time
    meets the same deadline as one that stalls.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            400,
            f"request body is larger than {self.max_bytes} bytes (max_request_bytes)",
            param="body",
            code="request_too_large",
        )
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(send, too_large, _CLOSE)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except asyncio.TimeoutError:
            too_slow = APIError(
                408,
                f"request body not received within {self.read_timeout_s:g} s (body_read_timeout)",
                param="body",
                code="request_timeout",
            )
            await _send_error(send, too_slow, _CLOSE)
            return
        except _BodyTooLarge:
            await _send_error(send, too_large, _CLOSE)
            return
        if body is None:
            return  # the client left
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None when the client disconnects first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _BodyTooLarge(Exception):
    pass


class ApiKeyMiddleware:
    """Every route but the probes and /metrics needs `Authorization: Bearer <key>`.

    It runs before the body is read: a refused client is answered at once and the
    connection closed, so a stranger cannot hold a connection open with a slow body.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"authorization") or "").encode()
        if not hmac.compare_digest(given, self.expected):
            error = APIError(
                401,
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
            await _send_error(send, error, [(b"www-authenticate", b"Bearer"), *_CLOSE])
            return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
