"""Disaggregated mode on the real engine: prefill on CPU devices 0-1, generate on 2-3.

Each engine holds its own params on its own tensor-parallel mesh; the transfer
stage moves every prefix's KV between them. Greedy outputs must equal those of
one interleaved engine on one device, for 3 x slots requests at once.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import jax

from engine.engine import Engine, EngineConfig
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams
from tokenization import Tokenizer

SLOTS = 4
GREEDY = SamplingParams(temperature=0.0)


def engine(folder: Path, devices: tuple[int, ...]) -> Engine:
    return Engine(
        EngineConfig(
            folder,
            max_slots=SLOTS,
            max_model_len=96,
            prefill_buckets=(64,),  # few shapes: three engines compile them, no warm-up
            max_prefill_batch=1,
            prefill_chunk=None,
            tensor_parallel_size=len(devices),
            devices=devices,
        )
    )


def outputs(orchestrator: Orchestrator, cases: list[tuple[int, ...]]) -> list[list[int]]:
    orchestrator.start()
    try:
        streams = [
            orchestrator.submit(ActiveRequest(f"r{i}", p, GREEDY, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(cases)
        ]
        return [[t for d in s.collect(timeout=120) for t in d.token_ids] for s in streams]
    finally:
        orchestrator.stop()


def test_prefill_and_generate_on_their_own_devices_give_the_interleaved_outputs(
    tiny_checkpoint: Path,
) -> None:
    tokenizer = Tokenizer.from_folder(tiny_checkpoint)
    streams = text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids)
    rng = random.Random(3)
    cases = [tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 64))) for _ in range(12)]
    assert len(cases) == 3 * SLOTS
    interleaved = outputs(Orchestrator(engine(tiny_checkpoint, (0,)), streams), cases)

    prefill, generate = engine(tiny_checkpoint, (0, 1)), engine(tiny_checkpoint, (2, 3))
    moved: list[Any] = []
    receive = generate.receive

    def watched(prefix: Any) -> Any:
        out = receive(prefix)
        moved.append(out.cache[0][0])
        return out

    generate.receive = watched  # type: ignore[method-assign]
    both = Orchestrator(generate, streams, prefill_engine=prefill)
    assert outputs(both, cases) == interleaved
    assert len(moved) == len(cases)
    generate_devices = {d for d in jax.devices() if d.id in (2, 3)}
    assert all(cache.sharding.device_set == generate_devices for cache in moved)
    assert {d.id for d in prefill.params["embed"].sharding.device_set} == {0, 1}
    assert {d.id for d in generate.params["embed"].sharding.device_set} == {2, 3}
