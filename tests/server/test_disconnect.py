"""Clients that go away free their pages: aborts reach the engine core within a step."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.harness import SLOTS, LiveServer


def finished_samples(live: LiveServer) -> float:
    text = httpx.get(live.base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("llm_requests_finished_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def open_and_drop(client: httpx.AsyncClient, url: str, chat: bool) -> int:
    """Start a long stream, read two events, hang up; returns the events seen."""
    if chat:
        body = {"messages": [{"role": "user", "content": "Go on"}]}
    else:
        body = {"prompt": "Go on and on"}
    body |= {"max_tokens": 100, "stream": True, "ignore_eos": True, "temperature": 0.7}
    seen = 0
    path = "/chat/completions" if chat else "/completions"
    async with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break
    return seen


def test_dropped_streams_free_every_slot(live: LiveServer) -> None:
    runtime = live.app.state.runtime
    before = finished_samples(live)
    count = 3 * SLOTS

    async def drop_all() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *(open_and_drop(client, live.v1, chat=i % 2 == 0) for i in range(count))
            )

    assert asyncio.run(drop_all()) == [2] * count

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = runtime.stats()
        if stats.kv_pages_used == 0 and stats.waiting_requests == 0 and runtime.inflight == 0:
            break
        time.sleep(0.02)
    stats = runtime.stats()
    assert (stats.kv_pages_used, stats.waiting_requests, stats.running_requests) == (0, 0, 0)
    assert runtime.inflight == 0
    # the aborted requests did not run to their end
    assert finished_samples(live) - before < count

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        live.v1 + "/completions",
                        json={"prompt": f"Burst {i}", "max_tokens": 8, "ignore_eos": True},
                    )
                    for i in range(SLOTS)
                )
            )
        return [r.json() for r in responses]

    started = time.monotonic()
    results = asyncio.run(burst())
    assert time.monotonic() - started < 10
    assert [r["usage"]["completion_tokens"] for r in results] == [8] * SLOTS
