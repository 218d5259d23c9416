"""Fixtures of the engine tests: tiny checkpoints per architecture, and small engine cores."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def core_of(folder: Path, **options: Any) -> Any:
    """A small EngineCore: 4 sequences, context 128, steps of 32 tokens, chunks of 16,
    pages of 8 (options override any of them)."""
    from engine.core.core import CoreConfig, EngineCore

    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))


def run_core(core: Any, seqs: Iterable[Any], limit: int = 5000) -> dict[str, list[Any]]:
    """Add the sequences and step until every one has ended: each one's Emitted events."""
    seqs = list(seqs)
    out: dict[str, list[Any]] = {s.seq_id: [] for s in seqs}
    for seq in seqs:
        core.add(seq)
    for _ in range(limit):
        if not core.scheduler.busy:
            return out
        for event in core.step():
            out[event.seq_id].append(event)
    raise AssertionError("sequences did not finish")
