"""--kv-cache-memory-bytes: the KV pools fit the budget or the engine does not start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.engine import Engine, EngineConfig


def engine(folder: Path, **options: object) -> Engine:
    shapes = {"max_slots": 4, "max_model_len": 128, "prefill_buckets": (16, 32)}
    return Engine(EngineConfig(folder, **{**shapes, **options}))  # type: ignore[arg-type]


def pools(e: Engine) -> int:
    return sum(e.memory.values())


def test_the_prefix_pool_takes_what_the_budget_leaves(tiny_checkpoint_of) -> None:
    folder = tiny_checkpoint_of("llama")
    unbudgeted = engine(folder, prefix_cache_blocks=4)
    per_block = unbudgeted.memory["prefix_cache_bytes"] // 4
    fixed = unbudgeted.memory["decode_cache_bytes"] + unbudgeted.memory["prompt_buffer_bytes"]
    budget = fixed + 10 * per_block + per_block // 2
    e = engine(folder, prefix_cache_blocks=-1, kv_cache_memory_bytes=budget)
    assert e.cache_stats().prefix_blocks == 10
    assert pools(e) <= budget < pools(e) + per_block
    exact = engine(folder, prefix_cache_blocks=10, kv_cache_memory_bytes=budget)
    assert exact.memory == e.memory


def test_too_many_slots_for_the_budget_says_how_many_fit(tiny_checkpoint_of) -> None:
    folder = tiny_checkpoint_of("llama")
    full = engine(folder)
    per_slot = full.memory["decode_cache_bytes"] // 4
    budget = full.memory["prompt_buffer_bytes"] + 2 * per_slot + per_slot // 3
    with pytest.raises(ValueError, match="at most 2 slots") as info:
        engine(folder, kv_cache_memory_bytes=budget)
    assert re.search(r"decode cache of 4 slots \(\d+ bytes\)", str(info.value))
    assert pools(engine(folder, max_slots=2, kv_cache_memory_bytes=budget)) <= budget


def test_a_budget_below_one_request_is_refused(tiny_checkpoint_of) -> None:
    with pytest.raises(ValueError, match="cannot hold one max-length request"):
        engine(tiny_checkpoint_of("llama"), kv_cache_memory_bytes=1000)


def test_explicit_blocks_past_the_budget_are_refused(tiny_checkpoint_of) -> None:
    folder = tiny_checkpoint_of("llama")
    budget = pools(engine(folder)) + 100
    with pytest.raises(ValueError, match="at most 0 blocks"):
        engine(folder, prefix_cache_blocks=1, kv_cache_memory_bytes=budget)
    with pytest.raises(ValueError, match="-1 with kv_cache_memory_bytes"):
        engine(folder, prefix_cache_blocks=-1)
