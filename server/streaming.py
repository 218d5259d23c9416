"""SSE framing: `data: <json>` events with "\\n" line ends, `: ping` keep-alives, `[DONE]`.

Owns the shape of the bytes on the wire for every streamed response and the
response that sends them (`EventStream`); the handlers only produce JSON-able
dicts. The Responses API frames its events differently (`NamedEvents`): each
has an `event:` line and a `sequence_number`, and the stream ends without
`[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.errors import APIError

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
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


class EventStream(Response):
    """A `text/event-stream` response: each framed event is one body send, as it comes.

    Beside the sender run a `: ping` every `ping_interval` seconds (proxies cut quiet
    connections) and a watch for the client's disconnect, which cancels the sender
    (the events' iterator is closed, so its `finally` runs). sse-starlette did this
    with a cancel scope around every send, ~15% of the HTTP process's CPU at full
    occupancy (bench/README); here a send is the ASGI send alone.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        ping_interval: float,
        cleanup: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        self.events = events
        self.ping_interval = ping_interval
        self.cleanup = cleanup
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._closing = asyncio.Lock()  # the last send and a ping never interleave
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = self.raw_headers
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        if scope.get("method") == "HEAD":
            self.events = _nothing()
        sender = asyncio.ensure_future(self._send_events(send))
        helpers = [asyncio.ensure_future(self._until_disconnect(receive))]
        if self.ping_interval > 0:
            helpers.append(asyncio.ensure_future(self._ping(send)))
        try:
            await asyncio.wait((sender, helpers[0]), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, *helpers):
                task.cancel()
            await asyncio.gather(sender, *helpers, return_exceptions=True)
            await self.cleanup()
        error = None if sender.cancelled() else sender.exception()
        if error is not None:
            raise error  # a failed send, as itself

    async def _send_events(self, send: Send) -> None:
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:  # cancelled while the iterator waits at a yield: close it here
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        async with self._closing:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._complete = True

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(self.ping_interval)
            async with self._closing:
                if self._complete:
                    return
                await send({"type": "http.response.body", "body": PING, "more_body": True})

    @staticmethod
    async def _until_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


def sse_response(
    events: AsyncIterator[bytes],
    *,
    ping_interval: float,
    cleanup: Callable[[], Awaitable[None]],
    headers: dict[str, str] | None = None,
) -> EventStream:
    """Stream `events` (already framed) with keep-alive pings.

    `cleanup` runs after the response ends however it ends (it must be
    idempotent): when a client disconnects before the body iterator has even
    started, the iterator's own `finally` never runs, but this does.
    """
    return EventStream(
        events,
        ping_interval=ping_interval,
        cleanup=cleanup,
        headers={**STREAM_HEADERS, "Connection": "keep-alive", **(headers or {})},
    )
