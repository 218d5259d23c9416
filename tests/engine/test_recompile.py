"""After warm-up, serving every prompt length compiles nothing new."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from engine.types import SamplingParams
from tests.engine.conftest import batch_lengths

TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/backend_compile_duration",
)


@pytest.fixture
def compile_events() -> Iterator[list[str]]:
    """Names of jax tracing / compilation events recorded while the test runs."""
    events: list[str] = []
    recording = [True]

    def listener(event: str, duration: float, **_: object) -> None:
        if recording[0] and event in TRACE_EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    recording[0] = False


def test_no_compilation_after_warmup(small_engine, compile_events):
    engine = small_engine
    sizes_before = {name: f._cache_size() for name, f in jitted(engine).items()}
    state = engine.init_state()
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5, logprobs=3)
    for length in range(1, engine.max_prompt_len + 1):
        prompt = [(7 * i) % engine.vocab_size for i in range(length)]
        prefix = engine.prefill(prompt, sampling, prompt_logprobs=length % 7 == 0)
        if length % 5 == 0:
            prefix = engine.resample(prefix, SamplingParams(seed=length))
        slot = length % engine.max_slots
        state = engine.free(state, slot)
        state = engine.insert(prefix, state, slot)
        state, out = engine.generate(state)
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(engine).items()} == sizes_before


def test_a_long_decode_across_cache_chunks_compiles_nothing(small_engine, compile_events):
    """The step reads more cache chunks as a slot grows; that choice is made on the device."""
    engine = small_engine
    sizes_before = {name: f._cache_size() for name, f in jitted(engine).items()}
    state = engine.init_state()
    assert len(state.k_cache[0]) > 2  # the decode below crosses chunk boundaries
    state = engine.insert(engine.prefill([5], SamplingParams(seed=1)), state, 2)
    state = engine.insert(engine.prefill([7, 8], SamplingParams(seed=2)), state, 0)
    active = []
    for _ in range(engine.max_model_len):
        state, out = engine.generate(state)
        active.append(bool(np.asarray(out.active)[2]))  # indexing on the device compiles
    jax.block_until_ready(out.tokens)
    assert active.count(True) == engine.max_model_len - 1  # ran to the end of the cache
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(engine).items()} == sizes_before


def test_every_decode_bucket_is_compiled_by_warmup(small_engine, compile_events):
    """Each bucket, greedy alone (its own branch) and with other sampling, compiles nothing."""
    engine = small_engine
    sizes_before = {name: f._cache_size() for name, f in jitted(engine).items()}
    assert engine.decode_buckets == (1, 2, 4)
    state = engine.init_state()
    greedy = SamplingParams(temperature=0.0, seed=1)
    others = (SamplingParams(temperature=0.9, top_k=3, seed=2, logprobs=2), greedy)
    for batch in engine.decode_buckets:
        for sampling in (greedy, *others):
            state = engine.free(state, batch - 1)
            state = engine.insert(engine.prefill([3, 4, 5], sampling), state, batch - 1)
            state, out = engine.generate(state, batch)
            state, out, _ = engine.generate_with_logits(state, batch)
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(engine).items()} == sizes_before


def test_logit_bias_and_allowed_token_ids_compile_nothing(small_engine, compile_events):
    """Bias and bitmask arrays have fixed shapes; their branches are compiled by warm-up."""
    engine = small_engine
    sizes_before = {name: f._cache_size() for name, f in jitted(engine).items()}
    state = engine.init_state()
    bias = tuple((i, 1.0) for i in range(300))
    samplings = (
        SamplingParams(temperature=0.0, seed=1, logit_bias=((5, 100.0),)),
        SamplingParams(temperature=0.0, seed=2, allowed_token_ids=(3, 4)),
        SamplingParams(temperature=0.8, top_k=4, seed=3, logprobs=2, logit_bias=bias),
        SamplingParams(temperature=1.0, seed=4, allowed_token_ids=(9,), logit_bias=((9, -5.0),)),
    )
    for batch in engine.decode_buckets:
        for i, sampling in enumerate(samplings):
            slot = (batch - 1 + i) % batch
            state = engine.free(state, slot)
            prefix = engine.prefill([3, 4, 5, 6][: i + 1], sampling)
            state = engine.insert(engine.resample(prefix, sampling), state, slot)
            state, out = engine.generate(state, batch)
    long, short = batch_lengths(engine) or pytest.fail("no batched prefill shape")
    engine.prefill_batch([(([1, 2] * long)[:long], samplings[0]), ([3] * short, samplings[1])])
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(engine).items()} == sizes_before


def test_the_counter_sees_a_compilation(small_engine, compile_events):
    """The check above can fail: a new shape is noticed."""
    jax.jit(lambda x: x * 3)(jax.numpy.ones((3, 5, 7)))
    assert compile_events


def jitted(engine) -> dict[str, object]:
    return {name: f for name, f in vars(engine).items() if hasattr(f, "_cache_size")}


def test_structured_output_masks_compile_nothing(small_engine, compile_events):
    """A grammar's first mask rides in the sampling arrays; later masks are written by
    set_masks, one fixed shape compiled by warm-up, before steps of every bucket."""
    from tokenization import Tokenizer
    from tokenization.grammar import GrammarSpec

    engine = small_engine
    compiler = Tokenizer.from_folder(engine.config.model_path).grammar_compiler(engine.vocab_size)
    grammar = compiler.compile(GrammarSpec("regex", "[a-c]{3,9}"))
    sizes_before = {name: f._cache_size() for name, f in jitted(engine).items()}
    state = engine.init_state()
    for batch in engine.decode_buckets:
        slot = batch - 1
        matcher = grammar.matcher()
        sampling = SamplingParams(temperature=0.7, seed=batch, constraint=grammar)
        prefix = engine.prefill([3, 4, 5], sampling)
        state = engine.free(state, slot)
        state = engine.insert(engine.resample(prefix, sampling), state, slot)
        token = int(np.asarray(prefix.token))
        for _ in range(2):
            assert not matcher.advance(token)
            slots = np.full((engine.max_slots,), engine.max_slots, np.int32)
            masks = np.full((engine.max_slots, state.sampling.allowed.shape[1]), -1, np.int32)
            slots[slot] = slot
            matcher.fill_mask(masks[slot])
            state = engine.set_masks(state, slots, masks)
            state, out = engine.generate(state, batch)
            token = int(np.asarray(out.tokens)[slot])
    jax.block_until_ready(out.tokens)
    assert compile_events == []
    assert {name: f._cache_size() for name, f in jitted(engine).items()} == sizes_before
