"""The vocab-major head of decode steps (EngineConfig.vocab_major_head) on a real engine: the
backend's choice, logits that match the hidden-major engine's, and tokens that do not depend
on the batch a request runs in, in either layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.config import load_model_config, tensor_parallel
from engine.engine import Engine, EngineConfig, vocab_major_head
from engine.mesh import default_mesh
from engine.types import SamplingParams
from tests.engine.test_batch_invariance import TARGET, run_alone, run_among_others


@pytest.fixture(scope="module")
def hidden_major_engine(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    return Engine(EngineConfig(folder, max_slots=4, max_model_len=64, vocab_major_head=False))


def test_the_cpu_backend_takes_it_in_float32_with_the_whole_head(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    cfg = load_model_config(folder)
    one = default_mesh(1)
    assert vocab_major_head(EngineConfig(folder), cfg, one)
    assert not vocab_major_head(EngineConfig(folder, dtype="bfloat16"), cfg, one)
    assert not vocab_major_head(EngineConfig(folder, vocab_major_head=False), cfg, one)
    assert vocab_major_head(EngineConfig(folder, dtype="bfloat16", vocab_major_head=True), cfg, one)
    split = tensor_parallel(cfg, 2)
    assert split.head_shards == 2
    two = default_mesh(2)
    assert not vocab_major_head(EngineConfig(folder, tensor_parallel_size=2), split, two)
    asked = EngineConfig(folder, tensor_parallel_size=2, vocab_major_head=True)
    with pytest.raises(ValueError, match="whole head"):
        vocab_major_head(asked, split, two)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1.0, seed=1234)],
    ids=["greedy", "seeded-temperature-1"],
)
def test_hidden_major_tokens_same_alone_and_in_a_full_batch(hidden_major_engine, sampling):
    """The default (vocab-major) engine is test_batch_invariance's small_engine."""
    assert not hidden_major_engine.model_config.vocab_major_head
    assert run_alone(hidden_major_engine, sampling) == run_among_others(
        hidden_major_engine, sampling
    )


def test_logits_match_the_hidden_major_engine_and_keep_their_bits_across_buckets(
    small_engine, hidden_major_engine
):
    """Bucket 2 (the request with one idle slot) and bucket 4 (beside three others) give
    the request the same bits; those are the hidden-major engine's within float32 rounding
    (its product sums in another order), and the greedy tokens are the same."""
    greedy = SamplingParams(temperature=0.0, seed=0)
    assert small_engine.model_config.vocab_major_head

    def steps(engine: Engine, neighbours: bool) -> tuple[list[np.ndarray], list[int]]:
        state = engine.insert(engine.prefill(TARGET, greedy), engine.init_state(), 0)
        if neighbours:
            for slot, prompt in ((1, [0, 5, 9]), (2, list(range(40, 60))), (3, [0, 77])):
                state = engine.insert(engine.prefill(prompt, greedy), state, slot)
        rows, tokens = [], []
        for _ in range(4):
            state, out, logits = engine.generate_with_logits(state, 4 if neighbours else 2)
            assert logits.shape == (4 if neighbours else 2, engine.vocab_size)
            rows.append(np.asarray(logits[0]))
            tokens.append(int(out.tokens[0]))
        return rows, tokens

    busy, busy_tokens = steps(small_engine, neighbours=True)
    alone, alone_tokens = steps(small_engine, neighbours=False)
    for a, b in zip(alone, busy, strict=True):
        np.testing.assert_array_equal(a, b)
    other, other_tokens = steps(hidden_major_engine, neighbours=True)
    for mine, theirs in zip(busy, other, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    assert busy_tokens == alone_tokens == other_tokens
    assert dataclasses.replace(small_engine.model_config, vocab_major_head=False) == (
        hidden_major_engine.model_config
    )
