"""Lifetime events reach the client: a Server-Timing header, and `server_timing` in the usage
chunk of a stream; and /metrics histograms of each phase."""

from __future__ import annotations

import json
import re

import httpx
import openai

from frontend.request import RequestTimings
from tests.server.harness import MODEL_NAME, LiveServer, sse_events
from tests.server.test_metrics import scrape, value

PHASES = ("queue", "prefill", "ttft", "decode", "total")


def parse_server_timing(header: str) -> dict[str, float]:
    found = {}
    for part in header.split(","):
        match = re.fullmatch(r"\s*([a-z]+);dur=([0-9.]+)\s*", part)
        assert match, header
        found[match[1]] = float(match[2])
    return found


def test_phases_of_hand_made_timings() -> None:
    t = RequestTimings(queued=10.0, prefill_start=10.5, prefill_end=11.5)
    t.first_token, t.finished = 11.5, 13.0
    assert t.phases() == {"queue": 0.5, "prefill": 1.0, "ttft": 1.5, "decode": 1.5, "total": 3.0}
    assert RequestTimings(queued=1.0).phases() == {}  # nothing happened yet: nothing said


def test_a_non_streaming_response_says_where_its_time_went(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.v1, api_key="none")
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME,
        prompt="Where did the time go",
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert raw.parse().usage.completion_tokens == 6
    phases = parse_server_timing(raw.headers["server-timing"])
    assert set(phases) == set(PHASES)
    assert phases["queue"] + phases["prefill"] <= phases["ttft"] + 0.2
    assert phases["ttft"] + phases["decode"] <= phases["total"] + 0.2
    assert phases["decode"] > 0  # five tokens after the first take steps


def test_a_stream_carries_its_timings_in_the_usage_chunk(live: LiveServer) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "time me"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=30) as response:
        events = sse_events(response.read().decode())
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["usage"]["completion_tokens"] >= 1 and last["choices"] == []
    assert set(last["server_timing"]) == set(PHASES)
    assert all(isinstance(ms, float) and ms >= 0 for ms in last["server_timing"].values())
    assert all("server_timing" not in json.loads(e) for e in events[:-2])


def test_each_phase_is_a_histogram(live: LiveServer) -> None:
    before = scrape(live)
    body = {"prompt": "histograms", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(live.v1 + "/completions", json=body, timeout=30).status_code == 200
    after = scrape(live)
    for name in (
        "llm_request_decode_time_seconds_count",
        "llm_request_queue_time_seconds_count",
        "llm_request_prefill_time_seconds_count",
    ):
        assert value(after, name) == value(before, name) + 1, name
    assert not any(name.startswith("llm_request_slot_wait") for name, _ in after)
