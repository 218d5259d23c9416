"""Running streams' inter-token latency while a long prompt arrives among them, through HTTP.

Run: `python -m bench.long_prompt --model 70m-128k [--context 1024] [--streams 8]
[--output 128] [--fraction 0.75] [--rounds 3] [--server-arg=--prefill-chunk=128]
[--json PATH]`. --model is a checkpoint folder or a name bench.models builds.

One server (ours), started once. Each round runs two cases back to back, the order
alternating from round to round: `alone`, --streams greedy streams of random 64-token
prompts decoding --output tokens each (ignore_eos); `with_long`, the same streams, and
once every stream has its first token, one prompt of --fraction x context random tokens
(max_tokens 1). Inter-token gaps are the load generator's (bench.loadgen: SSE chunks, the
first gap excluded), the streams' only. Reported per round and pooled: the streams'
gap p50 and p99 in each case, their p99 with the long prompt over their p50 without it
(the engine-core issue's figure: <= 2), the worst gap while the long prompt was being
prefilled (from its send to its first token) over the same p50, and the long prompt's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.loadgen import Target, stream_one
from bench.metrics import RequestRecord, percentile
from bench.report import emit
from bench.run_serving import checkpoint
from bench.servers import ours, started
from bench.workload import RequestSpec
from engine.heap import freeze_startup_heap

PROMPT_TOKENS = 64


async def one_case(
    target: Target, streams: list[RequestSpec], long: RequestSpec | None
) -> dict[str, Any]:
    records = [RequestRecord(s.index, len(s.prompt), 0.0) for s in streams]
    freeze_startup_heap()  # as bench.loadgen: no full collection of this process mid-case
    connector = aiohttp.TCPConnector(limit=len(streams) + 1)
    timeout = aiohttp.ClientTimeout(total=600.0, connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as c:
        tasks = [
            asyncio.create_task(stream_one(c, target, s, r))
            for s, r in zip(streams, records, strict=True)
        ]
        long_record = None
        if long is not None:
            while not all(r.chunk_times for r in records):  # every stream is decoding
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
            long_record = RequestRecord(long.index, len(long.prompt), 0.0)
            await stream_one(c, target, long, long_record)
        await asyncio.gather(*tasks)
    failed = [r.error for r in records if r.error] + (
        [long_record.error] if long_record is not None and long_record.error else []
    )
    if failed:
        raise RuntimeError(f"requests failed: {failed[:3]}")
    gaps = [g for r in records for g in r.itl_s]
    out: dict[str, Any] = {
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "gaps": len(gaps),
    }
    if long_record is not None and long_record.chunk_times:
        start, first = long_record.sent, long_record.chunk_times[0]
        during = [
            b - a
            for r in records
            for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
            if b > start and a < first
        ]
        out["long_ttft_ms"] = (first - start) * 1e3
        out["worst_gap_during_long_ms"] = max(during, default=0.0) * 1e3
        out["gaps_during_long"] = len(during)
    return out


def specs(
    rng: np.random.Generator, vocab: int, streams: int, output: int, long_tokens: int
) -> tuple[list[RequestSpec], RequestSpec]:
    def prompt(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(10, vocab - 10, n))

    return (
        [RequestSpec(i, prompt(PROMPT_TOKENS), output) for i in range(streams)],
        RequestSpec(streams, prompt(long_tokens), 1),
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.75)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    folder, name = checkpoint(args.model, args.context)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    long_tokens = int(args.fraction * args.context)
    spec = ours()
    spec = type(spec)(spec.name, spec.argv + tuple(args.server_arg), spec.ready_path, spec.env)
    rng = np.random.default_rng(0)
    rounds: list[dict[str, Any]] = []
    with started(spec, folder, name, args.max_num_seqs, args.context) as running:
        target = Target(running.base_url + "/v1", name)
        warm_streams, warm_long = specs(rng, vocab, args.streams, 8, long_tokens)
        asyncio.run(one_case(target, warm_streams, warm_long))  # warm the path once
        for k in range(args.rounds):
            streams, long = specs(rng, vocab, args.streams, args.output, long_tokens)
            order = ("alone", "with_long") if k % 2 == 0 else ("with_long", "alone")
            result: dict[str, Any] = {}
            for case in order:
                began = time.perf_counter()
                result[case] = asyncio.run(
                    one_case(target, streams, long if case == "with_long" else None)
                )
                result[case]["seconds"] = time.perf_counter() - began
            base = result["alone"]["itl_p50_ms"]
            result["p99_with_over_p50_alone"] = result["with_long"]["itl_p99_ms"] / base
            result["worst_during_over_p50_alone"] = (
                result["with_long"]["worst_gap_during_long_ms"] / base
            )
            rounds.append(result)
            print(json.dumps({"round": k, **result}), flush=True)
    report = {
        "model": name,
        "context": args.context,
        "streams": args.streams,
        "output": args.output,
        "long_prompt_tokens": long_tokens,
        "server_args": args.server_arg,
        "rounds": rounds,
        "p99_with_over_p50_alone": [round(r["p99_with_over_p50_alone"], 2) for r in rounds],
        "worst_during_over_p50_alone": [round(r["worst_during_over_p50_alone"], 2) for r in rounds],
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
