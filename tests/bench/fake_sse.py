"""A scripted OpenAI-style SSE server on 127.0.0.1, for the load generator's arithmetic.

Each request's behaviour is chosen by its first prompt token id (a key of
`scripts`): how long before the first chunk, the gaps between chunks, how many
tokens usage reports, and how it fails (an HTTP status, an error event, or a
stream cut before [DONE]). Runs on its own thread with its own event loop;
counts the most requests it ever had open at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    first_s: float = 0.0  # delay before the first chunk
    gaps_s: tuple[float, ...] = ()  # delay before each later chunk
    usage_tokens: int | None = None  # None: no usage chunk
    status: int = 200
    error_after: int | None = None  # send an error event after this many chunks
    cut_after: int | None = None  # close the socket after this many chunks, no [DONE]
    piecewise: bool = False  # "\r\n" line ends, each event written a few bytes at a time


@dataclass
class FakeServer:
    scripts: dict[int, Script]
    port: int = 0
    open_now: int = 0
    most_open: int = 0
    bodies: list[dict] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            body = await _read_request(reader)
            self.bodies.append(body)
            await self._respond(writer, self.scripts[body["prompt"][0]])
        finally:
            self.open_now -= 1
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, script: Script) -> None:
        if script.status != 200:
            text = json.dumps({"error": {"message": "scripted failure"}}).encode()
            head = f"HTTP/1.1 {script.status} Error\r\nContent-Length: {len(text)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + text)
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        for n, delay in enumerate((script.first_s, *script.gaps_s)):
            if n == script.cut_after:
                return
            if n == script.error_after:
                writer.write(_event({"error": {"message": "scripted error event"}}))
                await writer.drain()
                return
            await asyncio.sleep(delay)
            event = _event({"choices": [{"index": 0, "text": f"t{n}\u2028"}]}) + b": ping\n\n"
            if not script.piecewise:
                writer.write(event)  # comments are not chunks
                await writer.drain()
                continue
            for start in range(0, len(event), 5):  # reads that end inside lines
                writer.write(event[start : start + 5].replace(b"\n", b"\r\n"))
                await writer.drain()
                await asyncio.sleep(0.001)
        if script.usage_tokens is not None:
            writer.write(
                _event({"choices": [], "usage": {"completion_tokens": script.usage_tokens}})
            )
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _read_request(reader: asyncio.StreamReader) -> dict:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    return json.loads(await reader.readexactly(length))


@contextmanager
def serve(scripts: dict[int, Script]) -> Iterator[FakeServer]:
    """Run a FakeServer on a free 127.0.0.1 port for the duration of the block."""
    fake = FakeServer(scripts)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        fake.port = server.sockets[0].getsockname()[1]
        started.set()
        async with server:
            await stop.wait()
        current = asyncio.current_task()
        handlers = [t for t in asyncio.all_tasks() if t is not current]
        for task in handlers:  # requests the client gave up on are still sleeping
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("fake SSE server did not start")
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
