"""Sequences running at once at one KV budget: whole-context slots against pages.

Run: `python -m bench.paged_concurrency [--model CKPT] [--context 2048] [--slots 4]
[--requests 48] [--slot-tree DIR] [--json PATH]`. Without --model it writes the tiny
test checkpoint with max_position_embeddings = --context (random weights; the shapes are
what matter here).

One server at a time, the same requests to each, all sent at once: prompts of 1/32 to
1/4 of the context, outputs of 1/128 to 1/16 of it (ignore_eos; the paged-KV issue's
mix, 64-2,048 and 64-512 at 8,192, scaled to --context). The KV budget is --slots whole
contexts. `slots`: the engine core limited to --slots sequences at that budget, which is
what a cache of whole-context slots holds; with --slot-tree (a checkout of a commit that
still has `--engine slot`), that slot engine itself, measured. `paged`: the engine core
with up to 8x the sequences at the same bytes. /metrics' llm_requests_running is read
every 20 ms; the report gives each server's peak and the ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.report import emit
from bench.servers import ours, started

RUNNING = re.compile(r"^llm_requests_running\{[^}]*\} ([0-9.e+]+)$", re.M)
KV_BYTES = re.compile(
    r'^llm_engine_memory_bytes\{[^}]*pool="(?:kv|decode)_cache"[^}]*\} ([0-9.e+]+)$', re.M
)


def requests(count: int, context: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(10, 200, int(rng.integers(context // 32, context // 4 + 1))).tolist(),
            int(rng.integers(max(1, context // 128), context // 16 + 1)),
        )
        for _ in range(count)
    ]


def metric(base: str, pattern: re.Pattern[str]) -> float:
    found = pattern.search(httpx.get(base + "/metrics", timeout=10).text)
    return float(found.group(1)) if found else 0.0


def serve_all(base: str, name: str, work: list[tuple[list[int], int]]) -> dict[str, float]:
    peak, done = 0.0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, metric(base, RUNNING))
            time.sleep(0.02)

    def send(item: tuple[list[int], int]) -> int:
        prompt, tokens = item
        body = {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(base + "/v1/completions", json=body, timeout=3600)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        produced = sum(pool.map(send, work))
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {"peak_running": peak, "seconds": round(seconds, 2), "tokens": produced}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument(
        "--slot-tree", type=Path, default=None, help="a checkout with --engine slot"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from engine.tiny import write_tiny_checkpoint

        model = write_tiny_checkpoint(
            Path(tempfile.mkdtemp()), max_position_embeddings=args.context
        )
    work = requests(args.requests, args.context)
    name = "bench"
    base = ours()
    queued = ("--max-queued-samples", str(4 * args.requests))
    report: dict[str, Any] = {"context": args.context, "requests": args.requests}
    if args.slot_tree is not None:  # the slot engine of an older checkout, as it ran
        env = base.env | {"PYTHONPATH": str(args.slot_tree)}
        older = tuple("--max-slots" if a == "--max-num-seqs" else a for a in base.argv)
        slot = dataclasses.replace(
            base,
            name="slot",
            argv=older + queued + ("--engine", "slot"),
            env=env,
            cwd=str(args.slot_tree),  # `python -m server` imports from the working directory
        )
    else:
        slot = dataclasses.replace(base, name="slot", argv=base.argv + queued)
    with started(slot, model, name, args.slots, args.context) as running:
        budget = int(metric(running.base_url, KV_BYTES))
        report["slot"] = serve_all(running.base_url, name, work)
    paged = dataclasses.replace(
        base, name="paged", argv=base.argv + queued + ("--kv-cache-memory-bytes", str(budget))
    )
    with started(paged, model, name, 8 * args.slots, args.context) as running:
        report["paged"] = serve_all(running.base_url, name, work)
    report["kv_cache_bytes"] = budget
    report["running_ratio"] = round(
        report["paged"]["peak_running"] / max(1.0, report["slot"]["peak_running"]), 2
    )
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
