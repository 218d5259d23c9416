"""Fixtures of the slot-engine tests: tiny checkpoints per architecture and small engines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint_of(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """arch, **options -> a tiny checkpoint folder, written once per distinct arguments."""
    from engine.tiny import write_tiny_checkpoint

    made: dict[tuple[Any, ...], Path] = {}

    def make(arch: str = "llama", **options: Any) -> Path:
        key = (arch, *sorted(options.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = write_tiny_checkpoint(folder, arch=arch, **options)
        return made[key]

    return make


@pytest.fixture(scope="module")  # tests/conftest.py drops compiled programs per module
def small_engine(tiny_checkpoint_of: CheckpointFactory) -> Any:
    """A warmed-up float32 tiny Llama engine: 4 slots, max_model_len 64, buckets 16/32/64."""
    from engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(tiny_checkpoint_of("llama"), max_slots=4, max_model_len=64))
    engine.warmup()
    return engine


def batch_lengths(engine: Any, count: int = 2) -> list[int] | None:
    """Lengths of `count` prompts that make one batched prefill call on a warmed-up engine,
    in the shortest bucket that has a batch shape (None: there is none). Which buckets
    batch depends on the machine: warm-up keeps only the shapes where a prompt has the
    bits it has alone (engine.engine.Engine._keep_exact_batch_shapes)."""
    buckets = [b for rows, b in engine.prefill_batch_shapes if rows >= count]
    if not buckets:
        return None
    top = min(min(buckets), engine.max_prompt_len)
    return [top - i for i in range(count)]
