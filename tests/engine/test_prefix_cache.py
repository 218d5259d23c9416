"""The prefix cache: the block index's arithmetic, then the real engine with a pool.

A hit computes only the rest of the prompt on top of cached KV; its logits match
the same prompt computed whole to float32 rounding (other matrix shapes), and
its greedy continuation is the same.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from engine.engine import Engine, EngineConfig
from engine.prefix_cache import PREFIX_BLOCK, PrefixIndex
from engine.types import SamplingParams
from tests.engine.conftest import batch_lengths
from tests.engine.test_recompile import compile_events, jitted  # noqa: F401

B = PREFIX_BLOCK
GREEDY = SamplingParams(temperature=0.0, seed=0)
TOL = 1e-5


def ids(n: int, salt: int = 0) -> list[int]:
    return [(17 * i + 3 + salt) % 250 for i in range(n)]


# -- the index ----------------------------------------------------------------------------


def test_a_stored_prompt_is_found_block_by_block_leaving_one_token_to_compute():
    index = PrefixIndex(blocks=8, block_size=B)
    prompt = ids(3 * B)
    assert index.lookup(prompt) == []
    plan = index.plan_store(prompt, cached=0)
    assert [i for i, _ in plan] == [0, 1, 2]
    # the whole prompt is 3 blocks, but its last token must be computed: 2 blocks match
    assert index.lookup(prompt) == [plan[0][1], plan[1][1]]
    assert index.lookup(prompt + [7]) == [block for _, block in plan]
    assert index.stats.queries == 3 * B * 3 + 1
    assert index.stats.hits == 2 * B + 3 * B


def test_a_block_matches_only_after_the_same_whole_prefix():
    index = PrefixIndex(blocks=8, block_size=B)
    first = ids(2 * B)
    index.plan_store(first, cached=0)
    other_head = ids(B, salt=1) + first[B:]  # the same second block after another first
    assert index.lookup(other_head + [1]) == []
    changed_tail = first[:B] + ids(B, salt=2)
    assert len(index.lookup(changed_tail + [1])) == 1
    assert index.plan_store(changed_tail, cached=1) == [(1, 2)]


def test_the_least_recently_used_chain_is_evicted_from_its_tail():
    index = PrefixIndex(blocks=3, block_size=B)
    a, b, c, d = (ids(n * B, salt=s) for n, s in ((2, 10), (1, 20), (1, 30), (1, 40)))
    index.plan_store(a, cached=0)
    index.plan_store(b, cached=0)
    assert len(index.lookup(a + [0])) == 2  # a is now the newest
    index.plan_store(c, cached=0)  # evicts b
    assert index.lookup(b + [0]) == []
    index.plan_store(d, cached=0)  # evicts a's tail, not its head
    assert len(index.lookup(a + [0])) == 1
    assert index.used == 3


def test_a_chain_longer_than_the_pool_keeps_its_head():
    index = PrefixIndex(blocks=2, block_size=B)
    assert [i for i, _ in index.plan_store(ids(5 * B), cached=0)] == [0, 1]
    assert len(index.lookup(ids(5 * B))) == 2


# -- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    config = EngineConfig(folder, max_slots=2, max_model_len=128, prefill_chunk=32)
    cached = Engine(dataclasses.replace(config, prefix_cache_blocks=16))
    cached.warmup()
    return cached, Engine(config)


def decode(engine: Engine, prompt: list[int], steps: int = 12) -> tuple[np.ndarray, list[int]]:
    prefix = engine.prefill(prompt, GREEDY)
    state = engine.insert(prefix, engine.init_state(), 0)
    tokens = [int(prefix.token)]
    for _ in range(steps):
        state, out = engine.generate(state)
        tokens.append(int(out.tokens[0]))
    return np.asarray(prefix.last_logits), tokens


@pytest.mark.parametrize("rest", [1, 5, 16, 40, 70])
def test_a_hit_computes_the_rest_and_matches_the_whole_prompt(engines, rest):
    cached, plain = engines
    shared = ids(3 * B, salt=rest)
    cached.prefill(shared + ids(7, salt=99), GREEDY)  # stores the 3 shared blocks
    before = cached.cache_stats()
    prompt = shared + ids(rest, salt=50)
    assert cached.prefill_parts(prompt) == -(-rest // 32)  # the rest, in chunks of 32
    logits, tokens = decode(cached, prompt)
    after = cached.cache_stats()
    assert after.prefix_hits - before.prefix_hits == 3 * B
    want_logits, want_tokens = decode(plain, prompt)
    np.testing.assert_allclose(logits, want_logits, atol=TOL)
    assert tokens == want_tokens


def test_prompt_logprobs_bypass_the_cache(engines):
    cached, _ = engines
    prompt = ids(2 * B + 3, salt=7)
    cached.prefill(prompt, GREEDY)
    before = cached.cache_stats()
    prefix = cached.prefill(
        prompt, SamplingParams(temperature=0.0, seed=0, logprobs=1), prompt_logprobs=1
    )
    assert len(prefix.prompt_logprobs) == len(prompt)
    assert cached.cache_stats().prefix_queries == before.prefix_queries


def test_hits_compile_nothing_after_warmup(engines, compile_events):  # noqa: F811
    cached, _ = engines
    sizes_before = {name: f._cache_size() for name, f in jitted(cached).items()}
    pool_before = {
        n: f._cache_size()
        for n, f in vars(cached.prefix_cache).items()
        if hasattr(f, "_cache_size")
    }
    state = cached.init_state()
    head = ids(2 * B, salt=3)
    for rest in (1, 9, 17, 33, 64, 90, 127 - 2 * B):
        prefix = cached.prefill(head + ids(rest, salt=rest), GREEDY)
        state = cached.insert(prefix, cached.free(state, 1), 1)
        state, out = cached.generate(state)
    for length in (batch_lengths(cached) or [])[:1]:  # batched prompts are stored too
        cached.prefill_batch([(ids(length, salt=1), GREEDY), (ids(length - 1, salt=2), GREEDY)])
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(cached).items()} == sizes_before
    pool_after = {
        n: f._cache_size()
        for n, f in vars(cached.prefix_cache).items()
        if hasattr(f, "_cache_size")
    }
    assert pool_after == pool_before


def test_peek_finds_what_lookup_would_and_changes_nothing():
    index = PrefixIndex(blocks=8, block_size=B)
    prompt = ids(3 * B + 2)
    index.plan_store(prompt, cached=0)
    before = (index.stats.queries, index.stats.hits)
    assert index.peek(prompt) == 3 and index.peek(ids(3 * B)) == 2  # one token left to compute
    assert index.peek(ids(3 * B, salt=1)) == 0
    assert (index.stats.queries, index.stats.hits) == before
    assert len(index.lookup(prompt)) == 3


def test_a_burst_sharing_a_cached_prefix_is_prefilled_one_by_one_with_hits(engines):
    """Through the orchestrator on the real engine: each prompt of a burst after the
    first finds the shared block."""
    from engine.orchestrator import Orchestrator
    from engine.request import ActiveRequest
    from engine.stages.detokenize import text_streams

    cached, _ = engines
    head = ids(B, salt=41)
    o = Orchestrator(cached, text_streams(lambda ids, skip: _NoText(), ()))
    o.start()
    try:
        first = ActiveRequest("warm", tuple(head + ids(3, salt=1)), GREEDY, 2)
        o.submit(first).collect(timeout=60)
        before = cached.cache_stats().prefix_hits
        burst = [
            o.submit(ActiveRequest(f"b{i}", tuple(head + ids(4 + i, salt=i)), GREEDY, 2))
            for i in range(4)
        ]
        for stream in burst:
            stream.collect(timeout=60)
    finally:
        o.stop()
    assert cached.cache_stats().prefix_hits - before == 4 * B


def test_prompts_with_cached_blocks_are_not_batched():
    """A batched prefill looks nothing up: the prefill stage sends prompts the cache
    would serve one by one, and batches the rest."""
    import threading

    from engine.fake import FakeEngine, FakeTokenizer
    from engine.orchestrator import Orchestrator
    from engine.request import ActiveRequest
    from engine.stages.detokenize import text_streams

    class Cached(FakeEngine):
        calls: list[tuple[int, ...]] = []
        inside, go = threading.Event(), threading.Event()

        def cached_tokens(self, token_ids):
            return B if token_ids[0] == 7 else 0

        def prefill(self, token_ids, sampling, **kw):
            if token_ids[0] == 1:  # the gate: the others queue up behind it
                self.inside.set()
                self.go.wait(10)
            self.calls.append((len(token_ids),) if token_ids[0] == 7 else (0,))
            return super().prefill(token_ids, sampling, **kw)

        def prefill_batch(self, prompts):
            self.calls.append(tuple(0 for _ in prompts))
            return super().prefill_batch(prompts)

    engine = Cached(max_slots=8, max_prefill_batch=8)
    tokenizer = FakeTokenizer()
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    o.start()
    try:
        streams = [o.submit(ActiveRequest("gate", (1,) * 5, GREEDY, 1))]
        assert engine.inside.wait(10)
        prompts = [(7 if i >= 3 else 3, *range(i, i + 20)) for i in range(6)]  # FIFO runs
        streams += [o.submit(ActiveRequest(f"r{i}", p, GREEDY, 2)) for i, p in enumerate(prompts)]
        engine.go.set()
        for stream in streams:
            stream.collect(timeout=10)
    finally:
        o.stop()
    alone = [c for c in engine.calls if c != (0,) and len(c) == 1 and c[0] > 0]
    batched = [c for c in engine.calls if len(c) > 1]
    assert len(alone) == 3  # the three prompts starting with 7, each its own call
    assert sum(len(c) for c in batched) == 3  # the other three, batched


class _NoText:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
