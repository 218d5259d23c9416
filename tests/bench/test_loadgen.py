"""The load generator against a scripted SSE server on 127.0.0.1.

Counts are exact (they do not depend on timing); times are only checked
against what the script makes impossible (a sleep never ends early), so a busy
machine cannot fail these tests, but an off-by-one in the arithmetic does.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.loadgen import Target, check_loopback, run_requests
from bench.metrics import full_occupancy_tok_s
from bench.workload import RequestSpec
from tests.bench.fake_sse import Script, serve

FIRST_S = 0.3  # scripted time to first chunk
GAP_S = 0.02

SCRIPTS = {
    1: Script(first_s=FIRST_S, gaps_s=(GAP_S,) * 4, usage_tokens=5),  # 5 chunks, 5 tokens
    2: Script(first_s=FIRST_S, gaps_s=(GAP_S,) * 2, usage_tokens=6),  # 3 chunks carry 6 tokens
    3: Script(status=500),
    4: Script(first_s=0.01, gaps_s=(GAP_S,) * 3, error_after=2),  # error event mid-stream
    5: Script(first_s=0.01, gaps_s=(GAP_S,) * 3, cut_after=2),  # no [DONE]
    6: Script(first_s=0.01, gaps_s=(GAP_S,) * 3),  # no usage: tokens = chunks
    7: Script(first_s=0.01, gaps_s=(GAP_S,) * 3, usage_tokens=4, piecewise=True),
}


def specs(*first_ids: int) -> list[RequestSpec]:
    return [RequestSpec(i, (fid, 9, 9), 5) for i, fid in enumerate(first_ids)]


def run(base_url: str, reqs: list[RequestSpec], concurrency: int | None):
    target = Target(base_url, "fake")
    return asyncio.run(run_requests(target, reqs, concurrency=concurrency, deadline_s=30))


def test_records_and_summary_against_scripted_server() -> None:
    with serve(SCRIPTS) as fake:
        result = run(fake.base_url, specs(1, 2, 3, 4, 5, 6), concurrency=2)
        assert fake.most_open <= 2
    records = {r.index: r for r in result.records}
    assert [len(records[i].chunk_times) for i in range(6)] == [5, 3, 0, 2, 2, 4]
    assert [records[i].output_tokens for i in (0, 1, 5)] == [5, 6, 4]
    assert records[2].error.startswith("HTTP 500")
    assert records[3].error.startswith("error event")
    assert records[4].error == "stream ended without [DONE]"

    s = result.summary()
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["output_tokens"] == 5 + 6 + 4
    assert s["prompt_tokens"] == 9
    assert s["short_outputs"] == 2  # asked for 5 tokens: got 6 (request 2) and 4 (request 6)
    assert s["output_tok_per_s"] == pytest.approx(15 / s["duration_s"])

    ok = [records[i] for i in (0, 1, 5)]
    # ITL excludes each first chunk: (5-1) + (3-1) + (4-1) samples
    assert sum(len(r.itl_s) for r in ok) == 9
    for r in ok:
        assert sum(r.itl_s) == pytest.approx(r.chunk_times[-1] - r.chunk_times[0])
    for r in ok[:2]:
        assert r.ttft_s >= FIRST_S  # the script slept this long before the first chunk
    # TPOT divides by tokens, not chunks: request 2 spread 5 later tokens over 2 gaps
    assert ok[1].tpot_s == pytest.approx((ok[1].e2e_s - ok[1].ttft_s) / 5)


def test_events_split_across_reads_with_crlf_line_ends_count_the_same() -> None:
    # Lines end in "\r\n" and arrive a few bytes per read; each event's text holds a raw
    # U+2028, which a splitlines-based reader would take for a line end.
    with serve(SCRIPTS) as fake:
        result = run(fake.base_url, specs(7, 6), concurrency=2)
    piecewise, whole = result.records
    assert piecewise.error is None and whole.error is None
    assert (len(piecewise.chunk_times), piecewise.output_tokens) == (4, 4)
    assert len(whole.chunk_times) == 4


def test_burst_sends_everything_at_once() -> None:
    scripts = {1: Script(first_s=1.0, gaps_s=(GAP_S,) * 3, usage_tokens=4)}
    with serve(scripts) as fake:
        result = run(fake.base_url, specs(1, 1, 1, 1, 1, 1), concurrency=None)
        assert fake.most_open == 6  # each holds its socket >= 1 s; all were sent at t=0
    assert result.summary()["completed"] == 6
    rate = full_occupancy_tok_s(result.records)
    assert rate is not None and rate > 0


def test_poisson_offsets_are_honoured() -> None:
    scripts = {1: Script(first_s=0.0, usage_tokens=1)}
    reqs = [RequestSpec(i, (1,), 1, send_at_s=0.2 * i) for i in range(3)]
    with serve(scripts) as fake:
        result = run(fake.base_url, reqs, concurrency=None)
    sent = sorted(r.sent for r in result.records)
    assert sent[1] - sent[0] >= 0.2 - 0.01 and sent[2] - sent[0] >= 0.4 - 0.01
    assert result.duration_s >= 0.4


def test_deadline_cuts_off_and_counts_failures() -> None:
    scripts = {1: Script(first_s=5.0, usage_tokens=1)}
    with serve(scripts) as fake:
        target = Target(fake.base_url, "fake")
        result = asyncio.run(run_requests(target, specs(1, 1), concurrency=1, deadline_s=0.3))
    s = result.summary()
    assert (s["completed"], s["failed"]) == (0, 2)
    assert all("deadline" in (r.error or "") for r in result.records)


def test_only_loopback_is_loaded() -> None:
    for url in ("http://127.0.0.1:1/v1", "http://localhost:1/v1", "http://[::1]:1/v1"):
        check_loopback(url)
    for url in ("http://10.0.0.1:1/v1", "http://example.com/v1", "http://192.168.1.2/v1"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(url)
