"""The serving metrics' arithmetic on synthetic timestamps: every number computed by hand."""

from __future__ import annotations

import math

import pytest

from bench.metrics import (
    RequestRecord,
    distribution,
    full_occupancy_tok_s,
    percentile,
    summarize,
)


def record(sent: float, chunks: list[float], tokens: int, **kw: object) -> RequestRecord:
    return RequestRecord(
        0, 10, sent, list(chunks), tokens, done=chunks[-1] if chunks else None, **kw
    )


def test_percentile_interpolates_linearly_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 2.5  # rank 1.5 between 2 and 3
    assert percentile(xs, 100) == 4.0
    ten = [float(i) for i in range(1, 11)]
    assert percentile(ten, 90) == pytest.approx(9.1)  # rank 8.1
    assert percentile(ten, 99) == pytest.approx(9.91)  # rank 8.91
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_distribution_keys_and_values() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0, 5.0])
    assert d == {
        "mean": 3.0,
        "p50": 3.0,
        "p90": pytest.approx(4.6),
        "p99": pytest.approx(4.96),
        "max": 5.0,
    }


def test_request_ttft_itl_tpot_e2e() -> None:
    r = record(10.0, [10.5, 10.6, 10.8, 11.1], tokens=4)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    # ITL excludes the first token: 4 chunks give 3 gaps, none of them the 0.5 s TTFT
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)


def test_tpot_uses_token_count_not_chunks() -> None:
    # 3 chunks carried 5 tokens (the server merged some): TPOT divides by 4 tokens after the first
    r = record(0.0, [1.0, 1.5, 3.0], tokens=5)
    assert r.tpot_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.5, 1.5])
    assert record(0.0, [1.0], tokens=1).tpot_s is None
    assert record(0.0, [1.0], tokens=1).itl_s == []


def test_summary_totals_and_failures() -> None:
    records = [
        record(0.0, [0.2, 0.3, 0.5], tokens=3, expected_output_tokens=3),
        record(0.5, [1.0, 1.2, 1.4, 1.6, 2.0], tokens=5, expected_output_tokens=6),
        RequestRecord(2, 10, 0.1, [0.4], 1, error="HTTP 500: boom"),
        RequestRecord(3, 10, 0.2, [], 0, done=0.3),  # answered, but no content at all
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors"] == ["HTTP 500: boom", "no content"]
    assert s["short_outputs"] == 1
    assert s["output_tokens"] == 8 and s["prompt_tokens"] == 20
    assert s["request_per_s"] == 1.0
    assert s["output_tok_per_s"] == 4.0
    assert s["total_tok_per_s"] == 14.0
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)  # 200 and 500 ms
    assert s["ttft_ms"]["p50"] == pytest.approx(350.0)
    # ITL pooled over successful requests: [0.1, 0.2] + [0.2, 0.2, 0.2, 0.4]; first tokens excluded
    itl = s["itl_ms"]
    assert itl["mean"] == pytest.approx(1300 / 6)
    assert itl["p50"] == pytest.approx(200.0)
    assert itl["max"] == pytest.approx(400.0)
    assert itl["p90"] == pytest.approx(300.0)  # rank 4.5 between 200 and 400
    assert s["tpot_ms"]["p50"] == pytest.approx((150.0 + 250.0) / 2)  # 0.3/2 and 1.0/4
    assert s["e2e_ms"]["max"] == pytest.approx(1500.0)
    assert s["chunks_per_token"] == 1.0


def test_summary_rejects_zero_duration() -> None:
    with pytest.raises(ValueError):
        summarize([], 0.0)


def test_full_occupancy_window() -> None:
    # both decode from t=1.0 (the later first chunk) to t=3.0 (the earlier last chunk)
    a = record(0.0, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5], tokens=7)
    b = record(0.0, [1.0, 2.0, 3.0], tokens=5)  # 2 tokens a chunk
    # in (1.0, 3.0]: a has 4 chunks of 1 token, b 2 chunks of 2 tokens -> 8 tokens in 2 s
    assert full_occupancy_tok_s([a, b]) == pytest.approx(4.0)
    failed = RequestRecord(1, 10, 0.0, [1.0, 2.0], 2, error="x")
    assert full_occupancy_tok_s([a, failed]) is None
    late = record(0.0, [3.5, 4.0], tokens=2)  # starts after a's last chunk: no common window
    assert full_occupancy_tok_s([a, late]) is None
