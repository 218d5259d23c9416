"""server.streaming.sse_response at the ASGI seam: what it sends, and how it ends.

A real response driven by a scripted ASGI `receive` and a recording `send`; the
live-server behaviour (pings through uvicorn, disconnects aborting the engine,
drain) is in test_sse, test_disconnect and test_drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from server.streaming import DONE, PING, encode_event, sse_response

SCOPE = {"type": "http", "method": "POST"}


class Recorder:
    """The ASGI send: every message, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]

    @property
    def ended(self) -> bool:
        return any(m.get("more_body") is False for m in self.messages)


class Lifecycle:
    """Counts the events iterator's `finally` and the response's cleanup, and whether the
    iterator was closed by the time the cleanup ran (asyncio.run would close it anyway,
    later, when the loop shuts down)."""

    def __init__(self) -> None:
        self.closed = 0
        self.cleaned = 0
        self.closed_at_cleanup = 0

    async def cleanup(self) -> None:
        self.cleaned += 1
        self.closed_at_cleanup = self.closed


def _never_disconnects() -> Any:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


def test_events_then_the_end_and_no_ping_after_it() -> None:
    life = Lifecycle()
    recorder = Recorder()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield encode_event({"n": 1})
            await asyncio.sleep(0.25)  # quiet: pings go out meanwhile
            yield encode_event({"n": 2})
            yield DONE
        finally:
            life.closed += 1

    async def main() -> None:
        response = sse_response(events(), ping_interval=0.05, cleanup=life.cleanup)
        await response(SCOPE, _never_disconnects(), recorder.send)
        await asyncio.sleep(0.2)  # a ping task left running would send after the end

    asyncio.run(main())
    start = recorder.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache"
    data = [b for b in recorder.bodies if b != PING]
    assert data == [encode_event({"n": 1}), encode_event({"n": 2}), DONE, b""]
    pings = recorder.bodies.index(encode_event({"n": 2}))
    assert PING in recorder.bodies[1:pings], "no keep-alive while the stream was quiet"
    assert recorder.bodies[-1] == b"" and recorder.messages[-1]["more_body"] is False
    assert (life.closed, life.cleaned, life.closed_at_cleanup) == (1, 1, 1)


def test_a_disconnect_while_the_events_wait_closes_them_and_cleans_up_once() -> None:
    life = Lifecycle()
    recorder = Recorder()
    waiting = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield encode_event({"n": 1})
            waiting.set()
            await asyncio.Event().wait()  # the engine has nothing yet
            yield encode_event({"n": 2})
        finally:
            life.closed += 1

    async def receive() -> dict[str, Any]:
        await waiting.wait()
        return {"type": "http.disconnect"}

    async def main() -> None:
        response = sse_response(events(), ping_interval=0, cleanup=life.cleanup)
        await asyncio.wait_for(response(SCOPE, receive, recorder.send), 5)

    asyncio.run(main())
    assert recorder.bodies == [encode_event({"n": 1})]
    assert not recorder.ended  # the client is gone: nothing more is written
    assert (life.closed, life.cleaned, life.closed_at_cleanup) == (1, 1, 1)


def test_a_failed_send_closes_the_events_and_raises_as_itself() -> None:
    life = Lifecycle()

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                yield encode_event({"n": 1})
        finally:
            life.closed += 1

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    async def main() -> None:
        response = sse_response(events(), ping_interval=0, cleanup=life.cleanup)
        await response(SCOPE, _never_disconnects(), send)

    with pytest.raises(OSError, match="connection reset"):
        asyncio.run(main())
    assert (life.closed, life.cleaned, life.closed_at_cleanup) == (1, 1, 1)
