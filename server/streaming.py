"""SSE framing: `data: <json>` events with "\\n" line ends, `: ping` keep-alives, `[DONE]`.

Owns the shape of the bytes on the wire for every streamed response and the
response that sends them (sse-starlette's EventSourceResponse, the project's chosen
package, in `sse_response`); the handlers only produce JSON-able dicts. The Responses
API frames its events differently (`NamedEvents`): each has an `event:` line and a
`sequence_number`, and the stream ends without `[DONE]`.
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
PING = b": ping\n\n"  # what `_ping` encodes to
_EVENT_TYPE = re.compile(r"[a-z_.]+")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Line breaks to Python's str.splitlines (and so to httpx's and requests' iter_lines) that
# JSON leaves raw: escaped, a generated U+2028 would split a `data:` line for those clients.
_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


# One encoder for every event: json.dumps with these options would build one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json(payload: dict[str, Any]) -> bytes:
    """Compact JSON never holds a raw newline, so one `data:` line suffices."""
    text = _ENCODER.encode(payload)
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


def _once(cleanup: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """`cleanup`, run by whichever of its two callers comes first."""
    done = False

    async def run() -> None:
        nonlocal done
        if not done:
            done = True
            await cleanup()

    return run


async def _cleaned(
    events: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """`events`, then `cleanup`: also when sending fails (the response's background task
    runs only after a response that ended without an error). `events` is closed first,
    so its own `finally` has run when the cleanup does."""
    try:
        async for event in events:
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        await cleanup()


def sse_response(
    events: AsyncIterator[bytes],
    *,
    ping_interval: float,
    cleanup: Callable[[], Awaitable[None]],
    headers: dict[str, str] | None = None,
) -> EventSourceResponse:
    """Stream `events` (already framed: bytes pass through sse-starlette unchanged) with a
    `: ping` every `ping_interval` seconds (0: none; proxies cut quiet connections).

    `cleanup` runs after the response ends however it ends (it must be idempotent): when
    a client disconnects before the body iterator has even started, the iterator's own
    `finally` never runs, but the background task does. The server drains streams itself
    (server.lifecycle), so sse-starlette's own drain on uvicorn's exit is off
    (server.__main__).
    """
    cleanup = _once(cleanup)
    return EventSourceResponse(
        _cleaned(events, cleanup),
        headers={**STREAM_HEADERS, **(headers or {})},
        ping=ping_interval,
        sep="\n",
        ping_message_factory=_ping,
        background=BackgroundTask(cleanup),
    )
