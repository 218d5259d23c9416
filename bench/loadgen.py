"""Load generator: streams requests to an OpenAI-compatible /v1/completions endpoint.

Run (against a server already up, here or a peer):

    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --workload chat \
        --concurrency 4 --tokenizer CHECKPOINT_DIR --out run.json

Owns: sending a list of RequestSpecs (bench.workload) at a fixed concurrency,
at their scheduled Poisson offsets, or all at once, and recording for each
request its send time and the arrival time of every content chunk
(bench.metrics.RequestRecord). Every request streams with usage included, at
temperature 0, with `ignore_eos` so it runs to `max_tokens` (vLLM's
benchmark does the same). A chunk counts as content when it carries a
choice (vLLM's rule for completions; our server sends no empty deltas). Load
goes only to loopback addresses unless `allow_remote` is set, and every run
is bounded by its request count and a deadline.

Why aiohttp, as vLLM's `bench serve` uses: the client shares the machine with the server,
and its CPU is taken from the server's. At 32 streams at full occupancy on 2 cores it used
0.07 of a core against httpx's 0.17 (`aiter_lines`), whose difference went to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx

from bench.metrics import RequestRecord, summarize
from bench.workload import RequestSpec, Vocabulary, Workload, build_requests
from engine.heap import freeze_startup_heap


@dataclass(frozen=True)
class Target:
    """Where to send and what to ask for."""

    base_url: str  # ends in /v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be http(s)://HOST:PORT/v1, got {self.base_url!r}")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.duration_s)


def check_loopback(base_url: str) -> None:
    """Refuse any host that is not this machine's loopback."""
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(
        f"refusing to load {host!r}: only loopback hosts (pass allow_remote to override)"
    )


def payload(target: Target, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": list(spec.prompt),
        "max_tokens": spec.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_one(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord
) -> None:
    """Send one request; fill `record` with chunk times, usage and any error. Never raises."""
    url = target.base_url.rstrip("/") + "/completions"
    record.sent = time.perf_counter()
    try:
        async with session.post(url, json=payload(target, spec)) as response:
            if response.status != 200:
                body = (await response.read()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status}: {body[:200]}"
                return
            pending = b""
            async for data in response.content.iter_any():
                lines = (pending + data).split(b"\n")
                pending = lines.pop()  # an unfinished line waits for the next read
                for line in lines:
                    if _take_line(record, line.rstrip(b"\r")):
                        return
    except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    record.error = "stream ended without [DONE]"  # [DONE] and error events return above


def _take_line(record: RequestRecord, line: bytes) -> bool:
    """One SSE line into `record`; True when the stream is over ([DONE] or an error)."""
    if not line.startswith(b"data:"):
        return False  # comments (": ping"), blank separators
    data = line[5:].strip()
    if data == b"[DONE]":
        record.done = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = len(record.chunk_times)
        return True
    _apply_event(record, json.loads(data), time.perf_counter())
    return record.error is not None


def _apply_event(record: RequestRecord, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        record.error = f"error event: {str(event['error'])[:200]}"
        return
    if event.get("choices"):
        record.chunk_times.append(now)
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])


async def run_requests(
    target: Target,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int | None,
    deadline_s: float,
    allow_remote: bool = False,
) -> RunResult:
    """Send `specs` (at most `concurrency` in flight; None: no cap) and record each.

    A request starts at its `send_at_s` offset or when a slot frees, whichever
    is later. Whatever is still open at `deadline_s` is cancelled and counted
    as failed.
    """
    if not allow_remote:
        check_loopback(target.base_url)
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # A full collection of this process (25-60 ms measured here) would stall every stream's
    # reads at once and show as the server's inter-token gaps; vLLM's bench serve does too.
    freeze_startup_heap()
    records = [
        RequestRecord(s.index, len(s.prompt), 0.0, expected_output_tokens=s.output_tokens)
        for s in specs
    ]
    gate = asyncio.Semaphore(concurrency or len(specs) or 1)
    connections = min(concurrency or len(specs), len(specs)) or 1
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s, connect=30.0)
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as client:
        started = time.perf_counter()

        async def one(spec: RequestSpec, record: RequestRecord) -> None:
            delay = started + spec.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                await stream_one(client, target, spec, record)

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(specs, records, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        ended = time.perf_counter()
    for task, record in zip(tasks, records, strict=True):
        if task in pending:
            record.error = f"not finished within the {deadline_s:g} s deadline"
    return RunResult(records, _duration(records, started, ended))


def _duration(records: Sequence[RequestRecord], started: float, ended: float) -> float:
    """First send to the last response seen (the deadline when something was cut off)."""
    ends = [r.done or (r.chunk_times[-1] if r.chunk_times else r.sent) for r in records]
    if any(r.error and "deadline" in r.error for r in records):
        return ended - started
    return max([*ends, started + 1e-9]) - started


def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The id of the first model the endpoint lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def vocabulary_of(folder: Path) -> Vocabulary:
    """The checkpoint's vocabulary size and special-token ids, from its files alone."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    special: set[int] = set()
    tok_file = folder / "tokenizer.json"
    if tok_file.is_file():
        added = json.loads(tok_file.read_text(encoding="utf-8")).get("added_tokens", [])
        special = {int(t["id"]) for t in added if t.get("special")}
    return Vocabulary(int(config["vocab_size"]), frozenset(special))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="http://127.0.0.1:PORT/v1")
    parser.add_argument("--model", help="model id (default: the first /v1/models lists)")
    parser.add_argument("--workload", default="chat", help="preset name or workload file")
    parser.add_argument("--concurrency", type=int, default=1, help="in flight (0: no cap)")
    parser.add_argument("--num-requests", type=int, help="default: the workload's count")
    parser.add_argument("--context", type=int, default=1024, help="for context_fraction lengths")
    vocab = parser.add_mutually_exclusive_group(required=True)
    vocab.add_argument("--tokenizer", type=Path, help="checkpoint folder (vocabulary, specials)")
    vocab.add_argument("--vocab-size", type=int)
    parser.add_argument("--api-key")
    parser.add_argument("--no-ignore-eos", action="store_true")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write summary and per-request records here")
    args = parser.parse_args(argv)

    workload = Workload.load(args.workload).resolve(args.context)
    voc = vocabulary_of(args.tokenizer) if args.tokenizer else Vocabulary(args.vocab_size)
    concurrency = args.concurrency or None
    count = args.num_requests or workload.requests.count(concurrency or 1)
    specs = build_requests(workload, count, voc, seed=args.seed)
    model = args.model or first_model(args.base_url, args.api_key)
    target = Target(args.base_url, model, args.api_key, ignore_eos=not args.no_ignore_eos)
    if workload.arrival == "burst":
        concurrency = None
    result = asyncio.run(
        run_requests(target, specs, concurrency=concurrency, deadline_s=args.deadline)
    )
    summary = result.summary()
    print(json.dumps(summary, indent=2))
    if args.out:
        records = [r.__dict__ for r in result.records]
        args.out.write_text(json.dumps({"summary": summary, "records": records}) + "\n")


if __name__ == "__main__":
    main()
