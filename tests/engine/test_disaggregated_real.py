"""Disaggregated mode on the real engine: prefill on CPU devices 0-1, generate on 2-3.

Each engine holds its own params on its own tensor-parallel mesh and warms up its
own part only; the transfer stage moves every prefix's KV between them. Serving
then compiles nothing on either side, and greedy outputs equal those of one
interleaved engine on one device, for 3 x slots requests at once.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import jax
import pytest

from engine.engine import Engine, EngineConfig
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams
from tests.engine.test_recompile import compile_events  # noqa: F401
from tokenization import Tokenizer

SLOTS = 4
GREEDY = SamplingParams(temperature=0.0)
# chunks of 32 past the largest bucket and a prefix cache: every prefill path
SHAPES = {"max_slots": SLOTS, "max_model_len": 128, "prefill_buckets": (16, 32)}
SHAPES |= {"prefill_chunk": 32, "prefix_cache_blocks": 8}


def engine(folder: Path, devices: tuple[int, ...]) -> Engine:
    config = EngineConfig(folder, tensor_parallel_size=len(devices), devices=devices, **SHAPES)
    return Engine(config)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Path) -> tuple[Engine, Engine]:
    prefill, generate = engine(tiny_checkpoint, (0, 1)), engine(tiny_checkpoint, (2, 3))
    prefill.warmup(generate=False)
    generate.warmup(prefill=False)
    return prefill, generate


def test_each_engine_warms_its_own_part_and_serving_compiles_nothing(pair, compile_events):  # noqa: F811
    """Every path (bucket, batch, chunks, a prefix-cache hit) compiles nothing afterwards."""
    prefill, generate = pair
    # the warm-up ran in the fixture, before compile_events started recording
    sampling = SamplingParams(temperature=0.7, seed=1)
    prompts = [list(range(1, n)) for n in (3, 20, 33, 70, 100)] + [list(range(1, 60))]
    prefixes = [prefill.prefill(p, sampling) for p in prompts]  # the last one: a hit
    for rows, bucket in prefill.prefill_batch_shapes[:1]:  # if warm-up kept one: (2, 16)
        prefixes += prefill.prefill_batch([(list(range(1, bucket)), sampling)] * rows)
    state = generate.init_state()
    for i, prefix in enumerate(prefixes):
        slot = i % 2
        state = generate.insert(generate.receive(prefix), generate.free(state, slot), slot)
        state, out = generate.generate(state, generate.decode_bucket(2))
    jax.block_until_ready(out.tokens)
    assert prefill.cache_stats().prefix_hits > 0
    assert compile_events == []


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
    tiny_checkpoint: Path, pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer.from_folder(tiny_checkpoint)
    streams = text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids)
    rng = random.Random(3)
    cases = [tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 90))) for _ in range(12)]
    assert len(cases) == 3 * SLOTS
    interleaved = outputs(Orchestrator(engine(tiny_checkpoint, (0,)), streams), cases)

    prefill, generate = pair
    moved: list[Any] = []
    receive = generate.receive

    def watched(prefix: Any) -> Any:
        out = receive(prefix)
        moved.append(out.cache[0][0])
        return out

    monkeypatch.setattr(generate, "receive", watched)
    both = Orchestrator(generate, streams, prefill_engine=prefill)
    assert outputs(both, cases) == interleaved
    assert len(moved) == len(cases)
    generate_devices = {d for d in jax.devices() if d.id in (2, 3)}
    assert all(cache.sharding.device_set == generate_devices for cache in moved)
    assert {d.id for d in prefill.params["embed"].sharding.device_set} == {0, 1}
    assert {d.id for d in generate.params["embed"].sharding.device_set} == {2, 3}
