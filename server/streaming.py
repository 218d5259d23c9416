"""SSE framing: `data: <json>` events with "\\n" line ends, `: ping` keep-alives, `[DONE]`.

Owns the shape of the bytes on the wire for every streamed response; the
handlers only produce JSON-able dicts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from server.errors import APIError

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event; compact JSON never holds a raw newline, so one line suffices."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def error_event(error: APIError) -> bytes:
    return encode_event(error.body())


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


def sse_response(
    events: AsyncIterator[bytes],
    *,
    ping_interval: float,
    cleanup: Callable[[], Awaitable[None]],
    headers: dict[str, str] | None = None,
) -> EventSourceResponse:
    """Stream `events` (already framed) with keep-alive pings.

    `cleanup` runs after the response ends however it ends (it must be
    idempotent): when a client disconnects before the body iterator has even
    started, the iterator's own `finally` never runs, but this does.
    """
    return EventSourceResponse(
        events,
        headers={**STREAM_HEADERS, **(headers or {})},
        ping=ping_interval,
        sep="\n",
        ping_message_factory=_ping,
        background=BackgroundTask(cleanup),
    )
