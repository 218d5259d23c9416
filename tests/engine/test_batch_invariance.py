"""A request's tokens do not depend on its slot, its start step, the other requests, or the
decode bucket its steps run in (alone: bucket 1, as the generate stage steps it)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.types import SamplingParams

TARGET = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223, 163]
OTHERS = (
    [0, 5, 9, 200, 17, 301, 44, 12, 9, 99, 100, 101, 7, 8, 9, 10, 11, 300, 301],
    [0, 77, 88],
    list(range(40, 70)),
)
STEPS = 12


def run_alone(engine, sampling: SamplingParams) -> list[int]:
    prefix = engine.prefill(TARGET, sampling)
    state = engine.insert(prefix, engine.init_state(), 0)
    tokens = [int(prefix.token)]
    for _ in range(STEPS):
        state, out = engine.generate(state, engine.decode_bucket(1))
        tokens.append(int(out.tokens[0]))
    return tokens


def run_among_others(engine, sampling: SamplingParams) -> list[int]:
    """Three other requests (mixed sampling) fill slots 0, 1, 3; the target joins slot 2 late."""
    state = engine.init_state()
    others = (
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.0, seed=12),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=13, presence_penalty=0.5),
    )
    for slot, prompt, params in zip((0, 1, 3), OTHERS, others, strict=True):
        state = engine.insert(engine.prefill(prompt, params), state, slot)
    for _ in range(3):
        state, _ = engine.generate(state)
    prefix = engine.prefill(TARGET, sampling)
    state = engine.insert(prefix, state, 2)
    tokens = [int(prefix.token)]
    for step in range(STEPS):
        state, out = engine.generate(state)
        assert np.asarray(out.active).all()
        tokens.append(int(out.tokens[2]))
        if step == 4:  # another request leaves and a new one takes its slot mid-flight
            state = engine.free(state, 1)
            state = engine.insert(engine.prefill([0, 9, 9, 9], others[0]), state, 1)
    return tokens


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1.0, seed=1234)],
    ids=["greedy", "seeded-temperature-1"],
)
def test_tokens_same_alone_and_in_a_full_batch(small_engine, sampling):
    alone = run_alone(small_engine, sampling)
    busy = run_among_others(small_engine, sampling)
    assert alone == busy
    if sampling.temperature > 0:
        other_seed = run_alone(small_engine, SamplingParams(temperature=1.0, seed=4321))
        assert other_seed != alone  # the seed really drives the draws


def test_a_deep_neighbour_changes_no_bit_of_a_short_request(small_engine):
    """A slot near the end of the cache makes each step read every cache chunk; a short
    request in another slot, which alone reads only the first chunk, gets the same bits.
    Alone it steps bucket 2, not 1: a one-row step's logits come from another product
    (engine.model.step_logits)."""
    engine = small_engine
    greedy = SamplingParams(temperature=0.0, seed=0)
    chunk = engine.init_state().v_cache[0][0].shape[2]
    deep = list(range(1, engine.max_prompt_len - 2))
    assert len(TARGET) + 3 < chunk and len(deep) // chunk == len(engine.init_state().k_cache[0]) - 1

    def run(with_deep: bool) -> list[np.ndarray]:
        state = engine.insert(engine.prefill(TARGET, greedy), engine.init_state(), 0)
        if with_deep:
            state = engine.insert(engine.prefill(deep, greedy), state, 3)
        rows = []
        for _ in range(3):
            batch = engine.decode_bucket(4 if with_deep else 2)
            state, _, logits = engine.generate_with_logits(state, batch)
            rows.append(np.asarray(logits[0]))
        return rows

    for alone, busy in zip(run(with_deep=False), run(with_deep=True), strict=True):
        np.testing.assert_array_equal(alone, busy)
