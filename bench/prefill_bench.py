"""Long prompts among running streams, and prefix-cache hits, through the orchestrator.

Run from the repository root (one process, every figure a ratio within the run):

    python -m bench.prefill_bench --model CKPT [--context 2048] [--slots 16]

1. Interference: 8 greedy streams decode; a 0.75 x context prompt arrives while they
   do. Their inter-token latency p50 without it, and p99 over the window from its
   arrival to its first token, with chunked prefill (--prefill-chunk) and without.
2. Prefix cache: a prompt with a 1,500-token prefix (or 0.75 x context if shorter),
   then a second one sharing that prefix: the second's time to first token over the
   first's.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from engine.engine import Engine, EngineConfig
from engine.orchestrator import Orchestrator, OrchestratorConfig
from engine.request import ActiveRequest, Delta
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)
STREAMS = 8
STREAM_TOKENS = 256  # enough steps to outlast the long prompt's prefill


class _Ids:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def prompt(n: int, salt: int, vocab: int) -> tuple[int, ...]:
    return tuple((7919 * i + 104729 * salt + 13) % (vocab - 1) + 1 for i in range(n))


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def orchestrator(engine: Engine) -> Orchestrator:
    o = Orchestrator(
        engine,
        text_streams(lambda ids, skip: _Ids(), ()),
        OrchestratorConfig(max_queued_samples=64),
    )
    o.start()
    return o


def run_streams(o: Orchestrator, vocab: int, tokens: int, long: tuple[int, ...] | None) -> Any:
    """8 streams; with `long`, that prompt arrives once each has 8 tokens. Returns the
    streams' inter-token gaps (those overlapping the window from the long prompt's
    arrival to its first token, when there is one) and that window."""
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
    going = threading.Semaphore(0)

    def read(i: int) -> None:
        stream = o.submit(
            ActiveRequest(f"s{i}", prompt(128, i, vocab), GREEDY, tokens, ignore_eos=True)
        )
        for delta in stream:
            arrivals[i].append(delta.emitted)
            if len(arrivals[i]) == 8:
                going.release()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(STREAMS)]
    for r in readers:
        r.start()
    for _ in range(STREAMS):
        going.acquire()
    window = None
    if long is not None:
        sent = time.monotonic()
        deltas: list[Delta] = o.submit(
            ActiveRequest("long", long, GREEDY, 1, ignore_eos=True)
        ).collect(timeout=600)
        window = (sent, deltas[0].emitted)
    for r in readers:
        r.join()
    gaps = []
    for times in arrivals:
        for before, after in zip(times[8:], times[9:], strict=False):
            # a gap that overlaps the window, so a stall through it counts whole
            if window is None or (after >= window[0] and before <= window[1]):
                gaps.append(after - before)
    return gaps, window


def interference(engine: Engine, context: int) -> dict[str, float]:
    o = orchestrator(engine)
    try:
        vocab = engine.vocab_size
        base, _ = run_streams(o, vocab, STREAM_TOKENS, None)
        long = prompt(int(0.75 * context), 99, vocab)
        during, window = run_streams(o, vocab, STREAM_TOKENS, long)
    finally:
        o.stop()
    p50 = statistics.median(base)
    if not during:  # the streams ended before the long prompt's first token
        raise SystemExit("no stream decoded during the long prefill: raise STREAM_TOKENS")
    span = window[1] - window[0]
    return {
        "gaps_in_window": len(during),
        "stream_tokens_per_s_during_long_prefill": round(len(during) / span, 1),
        "stream_tokens_per_s_without": round(STREAMS / p50, 1),
        "itl_p50_ms_without": round(1e3 * p50, 2),
        "itl_p99_ms_during_long_prefill": round(1e3 * percentile(during, 99), 2),
        "p99_during_over_p50_without": round(percentile(during, 99) / p50, 3),
        "long_prompt_ttft_ms": round(1e3 * (window[1] - window[0]), 1),
    }


def prefix_hit(engine: Engine, context: int) -> dict[str, float]:
    o = orchestrator(engine)
    vocab = engine.vocab_size
    shared = prompt(min(1500, int(0.75 * context)), 7, vocab)
    ttfts = []
    try:
        for salt in (1, 2):
            request = ActiveRequest(f"p{salt}", shared + prompt(16, salt, vocab), GREEDY, 1)
            sent = time.monotonic()
            deltas = o.submit(request).collect(timeout=600)
            ttfts.append(deltas[0].emitted - sent)
    finally:
        o.stop()
    stats = engine.cache_stats()
    return {
        "shared_prefix_tokens": len(shared),
        "first_ttft_ms": round(1e3 * ttfts[0], 1),
        "second_ttft_ms": round(1e3 * ttfts[1], 1),
        "second_over_first": round(ttfts[1] / ttfts[0], 3),
        "prefix_hit_tokens": stats.prefix_hits,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefix-cache-blocks", type=int, default=256)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"model": args.model, "context": args.context, "slots": args.slots}
    base = EngineConfig(args.model, max_slots=args.slots, max_model_len=args.context)
    for name, config in (
        (
            f"chunked_{args.prefill_chunk}_prefix_cache",
            EngineConfig(
                **{
                    **vars(base),
                    "prefill_chunk": args.prefill_chunk,
                    "prefix_cache_blocks": args.prefix_cache_blocks,
                }
            ),
        ),
        ("whole_prompt", EngineConfig(**{**vars(base), "prefill_chunk": None})),
    ):
        started = time.monotonic()
        engine = Engine(config)
        engine.warmup()
        entry: dict[str, Any] = {"warmup_s": round(time.monotonic() - started, 1)}
        entry["interference"] = interference(engine, args.context)
        entry["prefix"] = prefix_hit(engine, args.context)
        results[name] = entry
        print(json.dumps({name: entry}), flush=True)
        del engine
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
