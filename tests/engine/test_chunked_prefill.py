"""Chunked prefill: a prompt past the largest bucket goes in chunks on top of its own KV.

Held to the unchunked prefill of the same prompt (logits, prompt logprobs, cache,
greedy continuation), to transformers (tests/engine/test_parity.py has the
unchunked side), to no compilation after warm-up, and to letting decode steps
through between chunks.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from engine.engine import Engine, EngineConfig
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams
from tests.engine.test_recompile import compile_events, jitted  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=3)
MAX_LEN = 100  # 99-token prompts; chunks of 32 need a 128-position buffer, past the cache's 112
LENGTHS = (33, 64, 65, 99)
# Chunked and whole prompts multiply matrices of other shapes, so float32 sums may round
# differently in the last bits; measured gaps on the tiny models are ~1e-6.
TOL = 1e-5


def prompt(length: int, vocab: int) -> list[int]:
    return [(31 * i + 7) % vocab for i in range(length)]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    chunked = Engine(EngineConfig(folder, max_slots=2, max_model_len=MAX_LEN, prefill_chunk=32))
    chunked.warmup()
    whole = Engine(EngineConfig(folder, max_slots=2, max_model_len=MAX_LEN, prefill_chunk=None))
    return chunked, whole


def test_buckets_stop_at_the_chunk_and_every_prompt_fits(engines):
    chunked, whole = engines
    assert chunked.prefill_buckets == (16, 32)
    assert chunked.max_prompt_len == MAX_LEN - 1 == whole.max_prompt_len
    assert whole.prefill_buckets[-1] == MAX_LEN


def test_prefill_parts_counts_the_calls_a_prompt_takes(engines):
    """What the prefill stage asks before a prompt's turn (its chunks run beside steps)."""
    chunked, whole = engines
    calls = []
    for length in (1, 32, *LENGTHS):
        ids = prompt(length, chunked.vocab_size)
        chunked.prefill(ids, GREEDY, between_chunks=lambda: calls.append(1))
        assert chunked.prefill_parts(ids) == len(calls) + 1, length
        calls.clear()
    assert [chunked.prefill_parts([1] * n) for n in (32, 33, 64, 65, 99)] == [1, 2, 2, 3, 4]
    assert whole.prefill_parts([1] * 99) == 1


def test_short_prompts_keep_the_unchunked_path(tiny_checkpoint_of):
    """A context the buckets already cover turns chunking off (nothing to compile)."""
    engine = Engine(EngineConfig(tiny_checkpoint_of("llama"), max_slots=1, max_model_len=64))
    assert engine.prefill_chunk is None and engine.max_prompt_len == 63


@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_logits_and_cache_match_the_whole_prompt(engines, length):
    chunked, whole = engines
    ids = prompt(length, chunked.vocab_size)
    calls = []
    a = chunked.prefill(ids, GREEDY, prompt_logprobs=3, between_chunks=lambda: calls.append(1))
    b = whole.prefill(ids, GREEDY, prompt_logprobs=3)
    assert len(calls) == -(-length // 32) - 1  # after every chunk but the last
    np.testing.assert_allclose(np.asarray(a.last_logits), np.asarray(b.last_logits), atol=TOL)
    assert int(a.token) == int(b.token)
    got = [(e.token_id, e.logprob) for e in a.prompt_logprobs[1:]]
    want = [(e.token_id, e.logprob) for e in b.prompt_logprobs[1:]]
    assert [t for t, _ in got] == [t for t, _ in want] == ids[1:]
    np.testing.assert_allclose([p for _, p in got], [p for _, p in want], atol=TOL)
    for ka, kb in zip(a.cache[0], b.cache[0], strict=True):
        np.testing.assert_allclose(
            np.asarray(ka)[..., :length], np.asarray(kb)[..., :length], atol=TOL
        )
    for va, vb in zip(a.cache[1], b.cache[1], strict=True):
        np.testing.assert_allclose(np.asarray(va)[:, :length], np.asarray(vb)[:, :length], atol=TOL)


def test_a_chunked_prompt_decodes_as_the_whole_prompt_does(engines):
    chunked, whole = engines
    ids = prompt(70, chunked.vocab_size)
    outputs = []
    for engine in (chunked, whole):
        state = engine.insert(engine.prefill(ids, GREEDY), engine.init_state(), 1)
        tokens = []
        for _ in range(MAX_LEN - len(ids)):
            state, out = engine.generate(state)
            tokens.append(int(out.tokens[1]))
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def test_chunked_prefill_compiles_nothing_after_warmup(engines, compile_events):  # noqa: F811
    chunked, _ = engines
    sizes_before = {name: f._cache_size() for name, f in jitted(chunked).items()}
    state = chunked.init_state()
    for length in (33, 50, 64, 65, 96, 97, 99):
        ids = prompt(length, chunked.vocab_size)
        prefix = chunked.prefill(ids, GREEDY, prompt_logprobs=length % 2 == 0)
        prefix = chunked.resample(prefix, SamplingParams(temperature=0.8, seed=length))
        state = chunked.free(state, 0)
        state = chunked.insert(prefix, state, 0)
        state, out = chunked.generate(state)
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(chunked).items()} == sizes_before


class ChunkWatcher(Engine):
    """Records, around each pause between chunks, how many decode steps went by; its decode
    steps take 10 ms more, so the running stream outlasts the long prompt's prefill."""

    def generate(self, state, batch=None):
        time.sleep(0.01)
        return super().generate(state, batch)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_seen: list[tuple[int, int]] = []
        self.steps = lambda: 0

    def prefill(self, token_ids, sampling, *, prompt_logprobs=False, between_chunks=None):
        if between_chunks is None:
            return super().prefill(token_ids, sampling, prompt_logprobs=prompt_logprobs)

        def watched() -> None:
            before = self.steps()
            between_chunks()
            self.steps_seen.append((before, self.steps()))

        return super().prefill(
            token_ids, sampling, prompt_logprobs=prompt_logprobs, between_chunks=watched
        )


def test_decode_steps_run_between_the_chunks_of_a_long_prompt(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    engine = ChunkWatcher(EngineConfig(folder, max_slots=2, max_model_len=512, prefill_chunk=16))
    engine.warmup()
    o = Orchestrator(engine, text_streams(lambda ids, skip: _Ids(), ()))
    engine.steps = lambda: o.stats().generate_steps
    o.start()
    try:
        running = o.submit(ActiveRequest("running", (1, 2, 3), GREEDY, max_tokens=400))
        first = threading.Event()
        deltas = []

        def watch() -> None:
            for delta in running:
                deltas.append(delta)
                first.set()

        reader = threading.Thread(target=watch)
        reader.start()
        assert first.wait(30)
        long = o.submit(ActiveRequest("long", tuple(prompt(90, engine.vocab_size)), GREEDY, 2))
        assert len(long.collect(timeout=60)) == 2
        reader.join(60)
        assert sum(len(d.token_ids) for d in deltas) == 400
    finally:
        o.stop()
    assert len(engine.steps_seen) == 5  # 90 tokens: 6 chunks of 16
    assert all(after > before for before, after in engine.steps_seen), engine.steps_seen


class _Ids:
    """A detokenizer that writes token ids (this test needs no tokenizer)."""

    def add(self, token_id: int) -> str:
        return f"{token_id} "

    def flush(self) -> str:
        return ""


class GatedEngine(Engine):
    """Its first prefill waits for a gate, so the prompts sent meanwhile queue up together."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.calls = 0

    def prefill(self, token_ids, sampling, **kw):
        self.calls += 1
        if self.calls == 1:
            assert self.gate.wait(30)
        return super().prefill(token_ids, sampling, **kw)


def test_long_prompts_queued_behind_a_short_one_are_prefilled_alone(engines, tiny_checkpoint_of):
    """The prefill stage asks whether queued prompts batch with the first; a chunked length
    is simply 'no' (it once raised StopIteration and killed the stage)."""
    chunked, _ = engines
    assert not chunked.batch_fits([20, 90]) and not chunked.batch_fits([90, 99])
    with pytest.raises(ValueError, match="chunked"):
        chunked.bucket_for(90)
    folder = tiny_checkpoint_of("llama")
    engine = GatedEngine(EngineConfig(folder, max_slots=4, max_model_len=MAX_LEN, prefill_chunk=32))
    o = Orchestrator(engine, text_streams(lambda ids, skip: _Ids(), ()))
    o.start()
    try:
        vocab = engine.vocab_size
        blocker = o.submit(ActiveRequest("blocker", (1, 2, 3), GREEDY, 2))
        time.sleep(0.2)  # the stage holds the blocker at the gate
        streams = [
            o.submit(ActiveRequest(f"r{n}", tuple(prompt(n, vocab)), GREEDY, 2))
            for n in (20, 90, 97, 40)
        ]
        engine.gate.set()
        for stream in [blocker, *streams]:
            assert sum(len(d.token_ids) for d in stream.collect(timeout=60)) == 2
        assert o.alive
    finally:
        o.stop()
