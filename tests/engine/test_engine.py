"""The Engine's contract with the orchestrator: shapes, limits, errors, slots, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine, EngineConfig, attention_chunk, default_buckets
from engine.types import MAX_LOGPROBS, PromptTooLongError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)


def test_shapes_and_limits(small_engine):
    assert small_engine.prefill_buckets == (16, 32, 64)
    assert small_engine.max_prompt_len == 63
    assert small_engine.eos_token_ids == frozenset({1})
    assert small_engine.vocab_size == 512


def test_default_buckets_end_at_the_max_prefill_length():
    assert default_buckets(100) == (16, 32, 64, 100)
    assert default_buckets(64) == (16, 32, 64)
    assert default_buckets(8) == (8,)


def test_cache_chunks_are_powers_of_two_covering_max_model_len(small_engine):
    assert [attention_chunk(n) for n in (8, 64, 100, 1024, 4096, 2**17)] == [
        16,
        16,
        16,
        128,
        256,  # at most 256 positions ...
        2048,  # ... while that needs at most 64 chunks
    ]
    state = small_engine.init_state()
    assert len(state.k_cache[0]) == 4
    # slots, kv heads, key blocks, head_dim, block (chunk 16 < KEY_BLOCK: one block)
    assert state.k_cache[0][0].shape == (4, 2, 1, 16, 16)
    assert state.v_cache[0][0].shape == (4, 2, 16, 16)  # slots, kv heads, chunk, head_dim
    assert state.v_cache[0][3].shape == (4, 2, 16, 16)


def test_config_validation(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(folder, dtype="float16")
    with pytest.raises(ValueError, match="max_slots"):
        EngineConfig(folder, max_slots=0)
    with pytest.raises(ValueError, match="increasing"):
        EngineConfig(folder, prefill_buckets=(32, 16))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(EngineConfig(folder, max_model_len=4096))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        Engine(EngineConfig(folder, max_model_len=64, prefill_buckets=(16, 128)))
    engine = Engine(EngineConfig(folder, max_model_len=128, max_prefill_len=40))
    assert engine.prefill_buckets == (16, 32, 40)
    assert engine.max_model_len == 128 and engine.max_prompt_len == 127  # chunked past 40
    unchunked = EngineConfig(folder, max_model_len=128, max_prefill_len=40, prefill_chunk=None)
    assert Engine(unchunked).max_prompt_len == 40


def test_prompt_too_long_names_both_numbers(small_engine):
    with pytest.raises(PromptTooLongError) as info:
        small_engine.prefill([3] * 64, GREEDY)
    assert "64" in str(info.value) and "63" in str(info.value)
    assert (info.value.prompt_tokens, info.value.limit) == (64, 63)
    assert small_engine.prefill([3] * 63, GREEDY).length == 63


def test_unseeded_or_empty_request_is_refused(small_engine):
    with pytest.raises(ValueError, match="seed"):
        small_engine.prefill([1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        small_engine.prefill([], GREEDY)
    with pytest.raises(ValueError, match="token id 512 is out of the vocabulary"):
        small_engine.prefill([1, 512, 3], GREEDY)
    with pytest.raises(ValueError, match="slot"):
        small_engine.insert(small_engine.prefill([1], GREEDY), small_engine.init_state(), 4)


def test_full_slot_stops_without_disturbing_the_others(small_engine):
    engine = small_engine
    short = [0, 10, 20, 30]

    def run(with_long: bool) -> tuple[list[int], list[bool]]:
        state = engine.insert(engine.prefill(short, GREEDY), engine.init_state(), 0)
        if with_long:
            state = engine.insert(engine.prefill([5] * 62, GREEDY), state, 3)
        tokens, long_active = [], []
        for _ in range(4):
            state, out = engine.generate(state)
            tokens.append(int(out.tokens[0]))
            long_active.append(bool(out.active[3]))
        lengths = np.asarray(state.lengths)
        assert lengths.max() <= engine.max_model_len
        return tokens, long_active

    alone, _ = run(with_long=False)
    together, long_active = run(with_long=True)
    assert together == alone
    # 62 prompt tokens + 2 steps fill the 64 positions; then the slot goes idle
    assert long_active == [True, True, False, False]


def test_free_stops_a_slot(small_engine):
    engine = small_engine
    state = engine.insert(engine.prefill([0, 1, 2], GREEDY), engine.init_state(), 1)
    state, out = engine.generate(state)
    assert bool(out.active[1])
    state = engine.free(state, 1)
    length = int(state.lengths[1])
    state, out = engine.generate(state)
    assert not np.asarray(out.active).any()
    assert int(state.lengths[1]) == length


def test_first_token_and_logprobs(small_engine):
    sampling = SamplingParams(temperature=0.0, seed=3, logprobs=4)
    prompt = [0, 50, 60, 70, 80, 90]
    prefix = small_engine.prefill(prompt, sampling, prompt_logprobs=4)
    logits = np.asarray(prefix.last_logits, np.float64)
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert int(prefix.token) == int(np.argmax(logits))
    assert np.asarray(prefix.top_ids).shape == (MAX_LOGPROBS,)
    np.testing.assert_array_equal(np.asarray(prefix.top_ids), np.argsort(-logprobs)[:MAX_LOGPROBS])
    np.testing.assert_allclose(float(prefix.logprob), logprobs.max(), atol=1e-5)
    entries = prefix.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    for entry in entries[1:]:
        assert len(entry.top) == 4
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6
    plain = small_engine.prefill(prompt, sampling)
    assert plain.prompt_logprobs is None
    np.testing.assert_allclose(np.asarray(plain.last_logits), logits, atol=1e-5)


def test_resample_draws_the_first_token_again(small_engine):
    prompt = [0, 11, 22, 33, 44]
    first = small_engine.prefill(prompt, SamplingParams(temperature=2.0, seed=1))
    draws = {
        int(small_engine.resample(first, SamplingParams(temperature=2.0, seed=s)).token)
        for s in range(2, 12)
    }
    assert len(draws) > 1
    again = small_engine.resample(first, SamplingParams(temperature=2.0, seed=1))
    assert int(again.token) == int(first.token)
    assert again.cache is first.cache
    fresh = small_engine.prefill(prompt, SamplingParams(temperature=2.0, seed=7))
    assert int(small_engine.resample(first, SamplingParams(temperature=2.0, seed=7)).token) == int(
        fresh.token
    )


def test_frequency_penalty_counts_every_token_of_its_own_request(small_engine):
    """Token counts are kept only while a busy slot uses penalties. A penalized request put
    into a slot whose previous, unpenalized request ran with stale counts still sees exactly
    its own tokens: with a penalty of 100 greedy never repeats a token, where the same prompt
    unpenalized does, and a neighbour without penalties decodes as it does alone."""
    engine = small_engine
    prompt, neighbour = [0, 7, 7, 7], [0, 30, 31]
    penalized = SamplingParams(temperature=0.0, seed=0, frequency_penalty=100.0)

    def decode(state, slot: int, steps: int, watch: int | None = None):
        mine, theirs = [], []
        for _ in range(steps):
            state, out = engine.generate(state)
            mine.append(int(out.tokens[slot]))
            if watch is not None:
                theirs.append(int(out.tokens[watch]))
        return state, mine, theirs

    fresh = engine.insert(engine.prefill(neighbour, GREEDY), engine.init_state(), 2)
    _, alone, _ = decode(fresh, 2, 20)

    state = engine.insert(engine.prefill(prompt, GREEDY), engine.init_state(), 0)
    state, plain, _ = decode(state, 0, 20)
    assert len(set(plain)) < len(plain), "the unpenalized prompt must repeat for this test"
    state = engine.free(state, 0)  # slot 0's counts were never kept: no penalties ran
    state = engine.insert(engine.prefill(neighbour, GREEDY), state, 2)
    first = engine.prefill(prompt, penalized)
    state = engine.insert(first, state, 0)
    state, tokens, beside = decode(state, 0, 20, watch=2)
    sequence = [int(first.token), *tokens]
    assert len(set(sequence)) == len(sequence), sequence
    assert beside == alone
