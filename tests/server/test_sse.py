"""Raw SSE on the wire (httpx, `curl -sN`): framing, [DONE], finish_reason, usage, UTF-8, stops."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.streaming import DONE, encode_event, sse_response
from tests.server.harness import LiveServer, free_port, pick_stop, sse_events

UNICODE_PROMPTS = [
    "Emoji 🙂🚀 and more 👩‍👩‍👧",
    "中文和日本語のテキスト",
    "Combining: e\u0301 a\u0308 n\u0303 Z\u0335\u0321",
]


def stream_raw(live: LiveServer, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", live.v1 + path, json=body, timeout=60) as response:
        raw = response.read()
    return response, raw


def parse(raw: bytes) -> list[dict]:
    events = sse_events(raw.decode("utf-8"))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_framing_and_usage(live: LiveServer) -> None:
    body = {
        "prompt": ["Hello", "Bye"],
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    response, raw = stream_raw(live, "/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    chunks = parse(raw)
    assert len({c["id"] for c in chunks}) == 1
    *text_chunks, usage_chunk = chunks
    by_choice: dict[int, list[dict]] = {}
    for chunk in text_chunks:
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
        assert chunk["usage"] is None
        choice = chunk["choices"][0]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1, 2, 3]
    for choices in by_choice.values():
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 4 * 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24


def test_chat_stream_role_first_and_finish_last(live: LiveServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    response, raw = stream_raw(live, "/chat/completions", body)
    chunks = parse(raw)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_the_same_text(live: LiveServer) -> None:
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "stream": True}
    result = subprocess.run(
        ["curl", "-sN", "-H", "Content-Type: application/json", "-d", json.dumps(body),
         live.v1 + "/completions"],
        capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    chunks = parse(result.stdout)
    whole = httpx.post(live.v1 + "/completions", json={**body, "stream": False}, timeout=60).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_keep_alive_pings_are_comments() -> None:
    """A stream that is quiet for a while carries `: ping` comments, framed like events."""

    async def slow_events() -> AsyncIterator[bytes]:
        await asyncio.sleep(1.0)
        yield encode_event({"n": 1})
        yield DONE

    async def cleanup() -> None:
        return None

    async def endpoint(_: Request) -> Response:
        return sse_response(slow_events(), ping_interval=0.2, cleanup=cleanup)

    app = Starlette(routes=[Route("/s", endpoint)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        raw = httpx.get(f"http://127.0.0.1:{port}/s", timeout=10).text
    finally:
        server.should_exit = True
        thread.join(5)
    assert raw.startswith(": ping\n\n")
    assert sse_events(raw) == ['{"n":1}', "[DONE]"]


@pytest.mark.parametrize("prompt", UNICODE_PROMPTS)
def test_unicode_prompts_stream_valid_utf8(live: LiveServer, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
            "echo": True, "ignore_eos": True}  # fmt: skip
    _, raw = stream_raw(live, "/completions", body)
    for block in raw.split(b"\n\n"):
        block.decode("utf-8")  # every event is valid UTF-8 on its own
    chunks = parse(raw)
    deltas = [c["choices"][0]["text"] for c in chunks]
    for delta in deltas:
        delta.encode("utf-8")  # no lone surrogates
    whole = httpx.post(live.v1 + "/completions", json={**body, "stream": False}, timeout=60).json()[
        "choices"
    ][0]["text"]
    assert "".join(deltas) == whole
    assert whole.startswith(prompt)


def test_line_separators_in_text_keep_each_event_on_one_line(live: LiveServer) -> None:
    # httpx's and requests' iter_lines split on every str.splitlines break, U+2028 included;
    # a raw one inside a `data:` line cut an event in two for those clients (a lost request).
    prompt = "one\u2028two\x85three\u2029four"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "echo": True,
            "ignore_eos": True}  # fmt: skip
    texts = []
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    assert "".join(texts).startswith(prompt)
    assert encode_event({"t": prompt}).decode("utf-8").splitlines() == [
        'data: {"t":"one\\u2028two\\u0085three\\u2029four"}',
        "",
    ]


@pytest.mark.parametrize("prompt", UNICODE_PROMPTS[:2])
def test_unicode_chat_stream_matches_whole(live: LiveServer, prompt: str) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    _, raw = stream_raw(live, "/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in parse(raw))
    whole = httpx.post(
        live.v1 + "/chat/completions", json={**body, "stream": False}, timeout=60
    ).json()["choices"][0]["message"]["content"]
    assert text == whole


def test_stop_string_never_leaks_into_a_chunk(live: LiveServer) -> None:
    base = {"prompt": "In the beginning", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    full = httpx.post(live.v1 + "/completions", json=base, timeout=60).json()
    text = full["choices"][0]["text"]
    # a 3-character stop string taken from the middle, so earlier chunks could hold its prefix
    stop = pick_stop(text, 3)
    _, raw = stream_raw(live, "/completions", {**base, "stop": stop, "stream": True})
    chunks = parse(raw)
    deltas = [c["choices"][0]["text"] for c in chunks]
    expected = text[: text.index(stop)]
    assert "".join(deltas) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # exactly the text before the match: no chunk carried any part of the stop string
    assert all(stop not in d for d in deltas)
