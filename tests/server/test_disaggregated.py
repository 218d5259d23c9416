"""Disaggregated serving through the real server (`--prefill-devices`,
`--generate-devices`; prompts on one CPU device, decoding on another): the same greedy,
seeded, stopped and grammar-constrained text as the one-device server, streamed or not,
from the openai SDK; /metrics counts both sets' KV cache."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from openai import OpenAI

from tests.server.harness import (
    MODEL_NAME,
    LiveServer,
    completion_texts,
    make_config,
    pick_stop,
    serve_in_thread,
)

PROMPTS = [
    "one two three one two three one two",
    "the cat sat on the mat the cat " * 4,  # a few whole pages of prompt to copy across
    "a b c d",
]


def completions(server: LiveServer, **extra: object) -> list[str]:
    return completion_texts(server, PROMPTS, 40, **extra)


def pool_bytes(server: LiveServer, pool: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    match = re.search(
        rf'^llm_engine_memory_bytes\{{[^}}]*pool="{pool}"[^}}]*\}} (\S+)$', text, re.M
    )
    assert match, f"no {pool} bytes in /metrics"
    return float(match.group(1))


def test_disaggregated_server_serves_the_one_device_text(
    live: LiveServer, tiny_checkpoint: Path
) -> None:
    greedy = {"temperature": 0.0}
    seeded = {"temperature": 0.9, "seed": 1234, "n": 2}
    config = make_config(tiny_checkpoint, prefill_devices="1", generate_devices="1")
    with serve_in_thread(config) as split:
        assert completions(split, **greedy) == completions(live, **greedy)
        assert completions(split, **seeded) == completions(live, **seeded)
        stop_at = pick_stop("".join(completions(live, **greedy)), 2)
        stopped = [
            OpenAI(base_url=s.v1, api_key="unused")
            .completions.create(
                model=MODEL_NAME, prompt=PROMPTS, max_tokens=40, stop=[stop_at], **greedy
            )
            .choices
            for s in (split, live)
        ]
        assert [c.text for c in stopped[0]] == [c.text for c in stopped[1]]
        assert "stop" in [c.finish_reason for c in stopped[0]]
        regex = {"structured_outputs": {"regex": "(ab|cd){3,9}x"}}
        constrained = [
            OpenAI(base_url=s.v1, api_key="unused")
            .completions.create(
                model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=40, extra_body=regex, **greedy
            )
            .choices[0]
            .text
            for s in (split, live)
        ]
        assert constrained[0] == constrained[1]
        assert re.fullmatch("(ab|cd){3,9}x", constrained[0]), constrained
        for pool in ("kv_cache", "weights"):  # one of each per set, the same size each
            assert pool_bytes(split, pool) == 2 * pool_bytes(live, pool)
