"""Decode batch buckets: a step over the first 1, 2, 4, ... slots is the full step, cut short.

The generate stage steps the smallest bucket that covers its highest busy slot;
the slots past it are neither computed nor touched, and the covered ones get
the same bits as in a step over every slot.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.engine import decode_buckets
from engine.fake import FakeDelays, FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)
MIXED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=2, presence_penalty=0.5)


def test_buckets_are_powers_of_two_up_to_the_slot_count(small_engine):
    assert [decode_buckets(n) for n in (1, 2, 3, 4, 6, 32)] == [
        (1,),
        (1, 2),
        (1, 2, 3),
        (1, 2, 4),
        (1, 2, 4, 6),
        (1, 2, 4, 8, 16, 32),
    ]
    assert [small_engine.decode_bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="busy_rows"):
        small_engine.decode_bucket(5)
    with pytest.raises(ValueError, match="decode buckets"):
        small_engine.generate(small_engine.init_state(), 3)


def host(tree):
    return jax.tree.map(lambda a: np.array(a), tree)


def test_a_bucket_steps_its_slots_as_the_full_step_and_leaves_the_rest(small_engine):
    engine = small_engine

    def filled():
        state = engine.init_state()
        state = engine.insert(engine.prefill([0, 42, 364, 78], GREEDY), state, 0)
        state = engine.insert(engine.prefill([0, 5, 9], MIXED), state, 1)
        return engine.insert(engine.prefill([0, 7, 7, 7, 7], GREEDY), state, 3)

    bucket, full = filled(), filled()
    bucket = engine.free(bucket, 3)  # busy slots 0 and 1: bucket 2; slot 3 idle, frozen
    full = engine.free(full, 3)
    frozen = host(bucket)
    for _ in range(4):
        bucket, small_out, small_logits = engine.generate_with_logits(bucket, 2)
        full, full_out, full_logits = engine.generate_with_logits(full)
        np.testing.assert_array_equal(np.asarray(small_logits), np.asarray(full_logits)[:2])
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "active"):
            got, want = (np.asarray(getattr(out, name)) for out in (small_out, full_out))
            np.testing.assert_array_equal(got[:2], want[:2])
            assert not np.any(got[2:])  # past the bucket: zeros, inactive
    after = host(bucket)
    for was, now in zip(jax.tree.leaves(frozen), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(was[2:], now[2:])  # every per-slot array, the cache too


def test_the_generate_stage_steps_the_bucket_of_its_highest_busy_slot():
    """One request alone steps bucket 1; three at once step bucket 4 while the third runs.
    The fake raises if a busy slot ever lay past the step's batch."""
    engine = FakeEngine(max_slots=8, delays=FakeDelays(generate=(0.001, 0.001)))
    tokenizer = FakeTokenizer()
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    o.start()
    try:
        alone = o.submit(ActiveRequest("alone", (1, 2, 3), GREEDY, max_tokens=6, ignore_eos=True))
        assert [t for d in alone.collect(10) for t in d.token_ids] == [
            fake_token((1, 2, 3), 0, i) for i in range(6)
        ]
        assert set(engine.step_batches) == {1}
        del engine.step_batches[:]
        streams = [
            o.submit(ActiveRequest(f"r{i}", (i, 5), GREEDY, max_tokens=12, ignore_eos=True))
            for i in range(3)
        ]
        for i, stream in enumerate(streams):
            tokens = [t for d in stream.collect(10) for t in d.token_ids]
            assert tokens == [fake_token((i, 5), 0, j) for j in range(12)]
    finally:
        o.stop()
    assert set(engine.step_batches) <= {1, 2, 4} and 4 in engine.step_batches
