"""SSE framing: `data: <json>` events with "\\n" line ends, `: ping` keep-alives, `[DONE]`.

Owns the shape of the bytes on the wire for every streamed response; the
handlers only produce JSON-able dicts. The Responses API frames its events
differently (`NamedEvents`): each has an `event:` line and a `sequence_number`,
and the stream ends without `[DONE]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from server.errors import APIError

DONE = b"data: [DONE]\n\n"
_EVENT_TYPE = re.compile(r"[a-z_.]+")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Line breaks to Python's str.splitlines (and so to httpx's and requests' iter_lines) that
# JSON leaves raw: escaped, a generated U+2028 would split a `data:` line for those clients.
_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _json(payload: dict[str, Any]) -> bytes:
    """Compact JSON never holds a raw newline, so one `data:` line suffices."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if _LINE_BREAKS.search(text):
        text = _LINE_BREAKS.sub(_escape, text)
    return text.encode("utf-8")


def encode_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event."""
    return b"data: " + _json(payload) + b"\n\n"


def error_event(error: APIError) -> bytes:
    return encode_event(error.body())


class NamedEvents:
    """One stream's Responses API events: `event: <type>` then `data: <json>`, numbered.

    Owns the stream's `sequence_number`s (0, 1, 2, ... in the order encoded), so
    whoever builds the events need not count them.
    """

    def __init__(self) -> None:
        self.sequence_number = 0

    def encode(self, payload: dict[str, Any]) -> bytes:
        """`payload` (with its "type") framed with the next sequence number."""
        event_type = str(payload["type"])
        if not _EVENT_TYPE.fullmatch(event_type):
            raise ValueError(f"not an SSE event name: {event_type!r}")
        body = {**payload, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + event_type.encode("ascii") + b"\ndata: " + _json(body) + b"\n\n"

    def error(self, error: APIError) -> bytes:
        """OpenAI's `error` event; its `error` object makes the openai SDK raise APIError."""
        return self.encode(
            {
                "type": "error",
                "code": error.code,
                "message": error.message,
                "param": error.param,
                "error": error.body()["error"],
            }
        )


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
