"""Drain, overload and loading on a real server over a paced engine (tests/server/paced.py).

The paced engine's slow steps keep streams open long enough to watch a drain from the
outside: readiness and new requests turn 503 at once, and streams still open at the
timeout end with an error event and [DONE]. (The real engine core's drain is tested
through SIGTERM in test_process.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.backend import Backend
from server.lifecycle import Runtime
from tests.server.harness import LiveServer, make_config, serve_in_thread, sse_events, wait_ready
from tests.server.paced import paced_backend as fake_backend


@pytest.fixture
def slow_server(tmp_path: Path) -> Iterator[LiveServer]:
    config = make_config(tmp_path, max_model_len=256)
    with serve_in_thread(config, loader=lambda: fake_backend(0.02)) as server:
        yield server


def start_drain(server: LiveServer, timeout: float) -> asyncio.Future[bool]:
    runtime: Runtime = server.app.state.runtime
    assert runtime._loop is not None
    return asyncio.run_coroutine_threadsafe(runtime.drain(timeout), runtime._loop)


async def read_stream(client: httpx.AsyncClient, url: str, opened: asyncio.Event) -> list[str]:
    body = {"prompt": "slow", "max_tokens": 200, "stream": True, "ignore_eos": True}
    raw = b""
    async with client.stream("POST", url, json=body) as response:
        async for piece in response.aiter_bytes():
            raw += piece
            opened.set()
    return sse_events(raw.decode())


def test_drain_timeout_ends_open_streams_with_an_error(slow_server: LiveServer) -> None:
    url = slow_server.v1 + "/completions"

    async def run() -> tuple[list[list[str]], int, int, bool, float]:
        async with httpx.AsyncClient(timeout=30) as client:
            opened = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(read_stream(client, url, e)) for e in opened]
            for event in opened:
                await event.wait()
            started = time.monotonic()
            drained = start_drain(slow_server, 0.3)
            await asyncio.sleep(0.05)
            ready = (await client.get(slow_server.base_url + "/ready")).status_code
            refused = (await client.post(url, json={"prompt": "late"})).status_code
            streams = await asyncio.gather(*tasks)
            return streams, ready, refused, await asyncio.wrap_future(drained), started

    streams, ready, refused, drained, started = asyncio.run(run())
    assert (ready, refused, drained) == (503, 503, False)
    assert time.monotonic() - started < 5
    for events in streams:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "shutdown"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert texts, "the stream had produced text before the drain cut it"


def test_drain_waits_for_short_streams(slow_server: LiveServer) -> None:
    url = slow_server.v1 + "/completions"

    async def run() -> tuple[list[str], bool]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": "short", "max_tokens": 10, "stream": True, "ignore_eos": True}
            raw = b""
            drained = None
            async with client.stream("POST", url, json=body) as response:
                async for piece in response.aiter_bytes():
                    raw += piece
                    drained = drained or start_drain(slow_server, 10)
            assert drained is not None
            return sse_events(raw.decode()), await asyncio.wrap_future(drained)

    events, drained = asyncio.run(run())
    assert drained is True
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("error" not in c for c in chunks)


def test_overload_is_429_with_retry_after(tmp_path: Path) -> None:
    def loader() -> Backend:
        return fake_backend(0.05, max_queued_samples=1)

    with serve_in_thread(make_config(tmp_path, max_model_len=256), loader=loader) as server:
        url = server.v1 + "/completions"

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"prompt": "busy", "max_tokens": 20, "ignore_eos": True}
                return await asyncio.gather(*(client.post(url, json=body) for _ in range(12)))

        responses = asyncio.run(run())
        statuses = [r.status_code for r in responses]
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        # and the server recovers once the queue empties
        ok = httpx.post(url, json={"prompt": "later", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


def test_not_ready_while_loading(tmp_path: Path) -> None:
    release = threading.Event()

    def loader() -> Backend:
        release.wait(30)
        return fake_backend(0.0)

    config = make_config(tmp_path, max_model_len=256)
    with serve_in_thread(config, loader=loader, wait=False) as server:
        assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 503
        health = httpx.get(server.base_url + "/health", timeout=5)  # vLLM: nothing answers yet
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        early = httpx.post(server.v1 + "/completions", json={"prompt": "x"}, timeout=5)
        assert early.status_code == 503
        assert early.json()["error"]["type"] == "service_unavailable"
        release.set()
        wait_ready(server.base_url, 10)
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert httpx.post(server.v1 + "/completions", json={"prompt": "x"}).status_code == 200


def test_non_streaming_client_that_hangs_up_frees_its_slot(slow_server: LiveServer) -> None:
    runtime: Runtime = slow_server.app.state.runtime
    body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True}  # 4 s of fake steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.v1 + "/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and (runtime.inflight or runtime.stats().kv_pages_used):
        time.sleep(0.02)
    assert runtime.inflight == 0 and runtime.stats().kv_pages_used == 0
