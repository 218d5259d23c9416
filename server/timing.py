"""A request's lifetime events for the client: the Server-Timing header and its JSON form.

A slow request shows where its time went (queue, prefill, ttft,
decode, total; frontend.request.RequestTimings.phases) without access to /metrics:
non-streaming responses carry a `Server-Timing` header (W3C Server Timing, which
browsers' developer tools and curl -v show), and streams, whose headers leave
before any of it is known, carry the same figures as `server_timing` in the
final usage chunk. A request with several prompts reports, per phase, its
slowest prompt.
"""

from __future__ import annotations

from collections.abc import Iterable

from frontend.request import RequestTimings


def phases_ms(timings: Iterable[RequestTimings]) -> dict[str, float]:
    """Per phase, the longest across the request's prompts, in milliseconds (0.1 ms)."""
    out: dict[str, float] = {}
    for each in timings:
        for name, seconds in each.phases().items():
            out[name] = max(out.get(name, 0.0), round(seconds * 1e3, 1))
    return out


def server_timing(timings: Iterable[RequestTimings]) -> str:
    """The Server-Timing header value: `queue;dur=1.2, prefill;dur=30.5, ...` (ms)."""
    return ", ".join(f"{name};dur={ms}" for name, ms in phases_ms(timings).items())
