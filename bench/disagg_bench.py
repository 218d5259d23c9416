"""Interleaved vs disaggregated on the same devices: short streams decode while long prompts
keep arriving.

Run from the repository root (one process, both modes, ratios within the run):

    python -m bench.disagg_bench --model CKPT [--devices 4] [--context 1024] [--slots 8]

Interleaved: one engine, tensor parallel over all devices, chunked prefill letting a
decode step through between chunks. Disaggregated: prefill on the first half of the
devices, generate on the other half, each a tensor-parallel mesh with its own
weights, a transfer stage between. In each mode `--streams` greedy streams decode
while `--long` prompts of half the context arrive one after another; reported: the
streams' inter-token latency p50 / p99 while the long prompts are in flight, their
tokens/s, and the long prompts' time to first token.

On the CPU, "devices" are XLA's host devices (--xla_force_host_platform_device_count)
and share the same cores: this run shows the mechanism and its overheads (a second
copy of the weights, the KV moved between meshes), not the isolation separate chips
give. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--long", type=int, default=4, help="long prompts, one after another")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run this as a script: the device count is set before jax loads")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"

    from engine.engine import Engine, EngineConfig

    half = args.devices // 2
    base = EngineConfig(
        args.model,
        max_slots=args.slots,
        max_model_len=args.context,
        prefill_chunk=args.prefill_chunk,
    )
    results: dict[str, Any] = {key: getattr(args, key) for key in vars(args)}
    modes = {
        "interleaved": lambda: (
            None,
            Engine(_on(base, tuple(range(args.devices)))),
        ),
        "disaggregated": lambda: (
            Engine(_on(base, tuple(range(half)))),
            Engine(_on(base, tuple(range(half, args.devices)))),
        ),
    }
    for name, build in modes.items():
        started = time.monotonic()
        prefill, engine = build()
        if prefill is None:
            engine.warmup()
        else:
            prefill.warmup(generate=False)
            engine.warmup(prefill=False)
        entry = {"warmup_s": round(time.monotonic() - started, 1)}
        entry |= mixed(engine, prefill, args)
        results[name] = entry
        print(json.dumps({name: entry}), flush=True)
        del prefill, engine
    inter, disagg = results["interleaved"], results["disaggregated"]
    results["disaggregated_over_interleaved"] = {
        key: round(disagg[key] / inter[key], 3)
        for key in ("itl_p50_ms", "itl_p99_ms", "stream_tokens_per_s", "long_ttft_p50_ms")
        if inter.get(key)
    }
    print(json.dumps(results, indent=2))


def _on(base: Any, ids: tuple[int, ...]) -> Any:
    import dataclasses

    return dataclasses.replace(base, devices=ids, tensor_parallel_size=len(ids))


def mixed(engine: Any, prefill: Any, args: argparse.Namespace) -> dict[str, float]:
    """Streams decode; long prompts arrive one after another; figures over that window."""
    from bench.prefill_bench import _Ids, percentile, prompt
    from engine.orchestrator import Orchestrator, OrchestratorConfig
    from engine.request import ActiveRequest
    from engine.stages.detokenize import text_streams
    from engine.types import SamplingParams

    greedy = SamplingParams(temperature=0.0, seed=0)
    o = Orchestrator(
        engine,
        text_streams(lambda ids, skip: _Ids(), ()),
        OrchestratorConfig(max_queued_samples=64),
        prefill_engine=prefill,
    )
    o.start()
    vocab = engine.vocab_size
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    stop = threading.Event()
    going = threading.Semaphore(0)

    def read(i: int) -> None:
        request = ActiveRequest(f"s{i}", prompt(32, i, vocab), greedy, None, ignore_eos=True)
        stream = o.submit(request)
        for delta in stream:
            arrivals[i].append(delta.emitted)
            if len(arrivals[i]) == 4:
                going.release()
            if stop.is_set():
                o.abort(f"s{i}")
                return

    readers = [threading.Thread(target=read, args=(i,)) for i in range(args.streams)]
    try:
        for r in readers:
            r.start()
        for _ in range(args.streams):
            going.acquire()
        window_start = time.monotonic()
        ttfts = []
        for k in range(args.long):
            long = prompt(args.context // 2, 100 + k, vocab)
            sent = time.monotonic()
            deltas = o.submit(ActiveRequest(f"l{k}", long, greedy, 4, ignore_eos=True)).collect(
                timeout=600
            )
            ttfts.append(deltas[0].emitted - sent)
        window_end = time.monotonic()
        stop.set()
        for r in readers:
            r.join(60)
    finally:
        o.stop()
    gaps = [
        after - before
        for times in arrivals
        for before, after in zip(times, times[1:], strict=False)
        if before >= window_start and after <= window_end
    ]
    span = window_end - window_start
    return {
        "stream_gaps": len(gaps),
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
        "itl_p99_ms": round(1e3 * percentile(gaps, 99), 2),
        "stream_tokens_per_s": round(len(gaps) / span, 1),
        "long_ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
        "long_prompt_tokens": args.context // 2,
    }


if __name__ == "__main__":
    main()
