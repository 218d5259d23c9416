"""Serving metrics from per-request timestamps: the arithmetic, and nothing else.

Owns the definitions, which follow vLLM's `bench serve` (and agree with
aiperf's and guidellm's where they overlap):

  ttft_s    first content chunk - request sent
  e2e_s     last content chunk - request sent
  itl_s     gaps between successive content chunks, the first chunk excluded
            (a request with k chunks gives k - 1 samples; all requests pooled)
  tpot_s    (e2e_s - ttft_s) / (output_tokens - 1), per request with >= 2 tokens
            (what aiperf and guidellm call inter-token latency)
  output_tokens  the server's usage.completion_tokens, else the chunk count

Totals are over the successful requests, divided by the run's duration (first
send to last response): request/s, output tokens/s, total (prompt + output)
tokens/s. Percentiles interpolate linearly between order statistics, as
numpy.percentile does by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the load generator saw of one request; times are time.perf_counter() seconds."""

    index: int
    prompt_tokens: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    done: float | None = None
    error: str | None = None
    expected_output_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e_s(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in 0..100, got {p}")
    if not values:
        return math.nan
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and max, in the unit of `values`; NaN when empty."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    out |= {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["max"] = max(values) if values else math.nan
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Totals and latency distributions (milliseconds) of one run."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in distribution(xs).items()}  # noqa: E731
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error or "no content" for r in failed})[:5],
        "short_outputs": sum(
            1
            for r in ok
            if r.expected_output_tokens is not None and r.output_tokens != r.expected_output_tokens
        ),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_per_s": len(ok) / duration_s,
        "output_tok_per_s": output / duration_s,
        "total_tok_per_s": (prompt + output) / duration_s,
        "ttft_ms": ms([r.ttft_s for r in ok]),
        "itl_ms": ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": ms([r.e2e_s for r in ok]),
        "chunks_per_token": (sum(len(r.chunk_times) for r in ok) / output if output else math.nan),
    }


def full_occupancy_tok_s(records: Sequence[RequestRecord]) -> float | None:
    """Output tokens/s while every one of `records` is decoding at once.

    The window runs from the last first chunk to the first last chunk: no
    request is waiting for its prefill or has finished inside it. Tokens in the
    window are its chunks, scaled per request by (output_tokens - 1) /
    (chunks - 1), which is 1 when the server sends one chunk a token. None when
    the window is empty or a request failed.
    """
    if not records or not all(r.ok and len(r.chunk_times) > 1 for r in records):
        return None
    start = max(r.chunk_times[0] for r in records)
    end = min(r.chunk_times[-1] for r in records)
    if end <= start:
        return None
    tokens = 0.0
    for r in records:
        per_chunk = (r.output_tokens - 1) / (len(r.chunk_times) - 1)
        tokens += per_chunk * sum(1 for t in r.chunk_times if start < t <= end)
    return tokens / (end - start)
