"""Batched prefill: prompts that arrive together are prefilled in one call, each exactly as alone.

The real engine's batched Prefix must equal the one-prompt Prefix bit for bit
(first token, its logprob, the last logits and every layer's K and V), so a
request's output never depends on who it was prefilled with. The prefill stage
then groups queued prompts into such calls, and a bad prompt in a group fails
alone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import engine.engine as engine_module
from engine.fake import FakeEngine, FakeTokenizer, fake_token
from engine.model import last_logits, logits_of, step_logits
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest, RequestRejected
from engine.stages.detokenize import text_streams
from engine.types import Prefix, SamplingParams
from tests.engine.test_orchestrator_faults import idle, tokens, wait_for

PROMPTS = [list(range(3, 40)), [0, 77, 88, *range(5, 50)], [0, 301, 44, *range(100, 140)]]
SAMPLINGS = [
    SamplingParams(temperature=0.0, seed=1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=2, logprobs=3),
    SamplingParams(temperature=1.0, seed=3),
]


def same(a: Any, b: Any) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


def assert_same_prefix(batched: Prefix, alone: Prefix) -> None:
    assert batched.length == alone.length
    names = ["token", "last_logits"]
    if alone.sampling.logprobs is not None:  # else the fields are unspecified
        names += ["logprob", "top_ids", "top_logprobs"]
    for name in names:
        assert same(getattr(batched, name), getattr(alone, name)), name
    for part, (got, want) in enumerate(zip(batched.cache, alone.cache, strict=True)):
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape and same(g, w), (part, layer)


def test_a_batched_prefix_is_the_prefix_alone_bit_for_bit(small_engine: Any) -> None:
    engine = small_engine
    assert engine.batch_fits([len(p) for p in PROMPTS])
    batched = engine.prefill_batch(list(zip(PROMPTS, SAMPLINGS, strict=True)))
    for prompt, sampling, prefix in zip(PROMPTS, SAMPLINGS, batched, strict=True):
        assert_same_prefix(prefix, engine.prefill(prompt, sampling))


def test_every_compiled_batch_shape_keeps_the_bits_of_a_prompt_alone(small_engine: Any) -> None:
    """The kernel XLA picks depends on the product's row count; shapes where a batched
    prompt's float32 sums would round differently from alone must not be compiled."""
    engine = small_engine
    assert engine.prefill_batch_shapes  # something is batched
    sampling = SamplingParams(temperature=0.0, seed=0)
    for rows, bucket in engine.prefill_batch_shapes:
        length = min(bucket, engine.max_prompt_len)
        prompts = [[(7 * r + i) % 300 for i in range(length - r % 3)] for r in range(rows)]
        batched = engine.prefill_batch([(p, sampling) for p in prompts])
        for prompt, prefix in zip(prompts, batched, strict=True):
            assert_same_prefix(prefix, engine.prefill(prompt, sampling))


def test_decoding_from_a_batched_prefix_gives_the_same_tokens(small_engine: Any) -> None:
    engine = small_engine

    def decode(prefix: Prefix) -> list[int]:
        state = engine.insert(prefix, engine.init_state(), 1)
        out_tokens = [int(prefix.token)]
        for _ in range(6):
            state, out = engine.generate(state)
            out_tokens.append(int(out.tokens[1]))
        return out_tokens

    batched = engine.prefill_batch(list(zip(PROMPTS, SAMPLINGS, strict=True)))
    for prompt, sampling, prefix in zip(PROMPTS, SAMPLINGS, batched, strict=True):
        assert decode(prefix) == decode(engine.prefill(prompt, sampling))


def test_batch_shapes_are_bounded(small_engine: Any) -> None:
    engine = small_engine  # buckets 16, 32, 64 (max_model_len 64), 2048 tokens a call at most
    assert engine.prefill_batch_shapes == ((2, 16), (2, 64), (4, 64), (8, 64))
    assert engine.max_prefill_batch == 8
    assert engine.batch_fits([40, 50, 33, 63])  # one bucket (64)
    assert engine.batch_fits([5, 12])  # two short ones still take one kernel
    assert not engine.batch_fits([5, 12, 3])  # 3 x 16 rows would take the other kernel
    assert not engine.batch_fits([5, 40])  # buckets 16 and 64: padding would waste work
    assert not engine.batch_fits([40] * 9)  # more rows than compiled
    with pytest.raises(ValueError, match="do not fit"):
        engine.prefill_batch([([1] * 5, SAMPLINGS[0]), ([1] * 40, SAMPLINGS[0])])


class GatedBatchEngine(FakeEngine):
    """Holds the first prefill until the gate opens, so later requests queue up behind it."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.poison: tuple[int, ...] | None = None

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        self.gate.wait(10)
        if tuple(token_ids) == self.poison:
            raise OverflowError("cannot convert")
        return super().prefill(token_ids, sampling, **kw)

    def prefill_batch(self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]) -> list:
        if any(tuple(ids) == self.poison for ids, _ in prompts):
            raise OverflowError("cannot convert")
        return super().prefill_batch(prompts)


def make(engine: FakeEngine) -> Orchestrator:
    tokenizer = FakeTokenizer()
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    o.start()
    return o


def request(rid: str, prompt: tuple[int, ...], **kw: Any) -> ActiveRequest:
    return ActiveRequest(rid, prompt, SamplingParams(temperature=0.0, seed=0), 6, **kw)


def test_queued_prompts_are_prefilled_together() -> None:
    engine = GatedBatchEngine(max_slots=8, max_prefill_batch=4)
    o = make(engine)
    try:
        first = o.submit(request("first", (1,)))
        wait_for(lambda: o.stats().queued_requests == 0)  # held inside prefill
        rest = [o.submit(request(f"r{i}", (i + 2,))) for i in range(6)]
        engine.gate.set()
        assert tokens(first) == [fake_token((1,), 0, k) for k in range(6)]
        for i, stream in enumerate(rest):
            assert tokens(stream) == [fake_token((i + 2,), 0, k) for k in range(6)]
        assert engine.batch_sizes == [1, 4, 2]
        wait_for(lambda: idle(o))
    finally:
        o.stop()


def test_echo_with_logprobs_and_other_buckets_are_not_batched() -> None:
    engine = GatedBatchEngine(max_slots=8, max_prefill_batch=4)
    o = make(engine)
    try:
        held = [o.submit(request("first", (1,)))]
        wait_for(lambda: o.stats().queued_requests == 0)
        held.append(o.submit(request("a", (2,))))
        held.append(o.submit(request("echo", (3,), prompt_logprobs=True)))  # needs all logits
        held.append(o.submit(request("b", (4,))))
        held.append(o.submit(request("long", tuple(range(5, 40)))))  # bucket 64, not 16
        engine.gate.set()
        for stream in held:
            assert len(tokens(stream)) == 6
        assert engine.batch_sizes == [1, 1, 1, 1, 1]  # FIFO: nothing may jump the queue
    finally:
        o.stop()


def test_a_bad_prompt_in_a_batch_fails_alone() -> None:
    engine = GatedBatchEngine(max_slots=8, max_prefill_batch=4)
    engine.poison = (3,)
    o = make(engine)
    try:
        first = o.submit(request("first", (1,)))
        wait_for(lambda: o.stats().queued_requests == 0)
        good = [o.submit(request(f"g{i}", (i + 10,))) for i in range(2)]
        bad = o.submit(request("bad", (3,)))
        engine.gate.set()
        with pytest.raises(RequestRejected):
            tokens(bad)
        for i, stream in enumerate([first, *good]):
            prompt = (1,) if i == 0 else (i + 9,)
            assert tokens(stream) == [fake_token(prompt, 0, k) for k in range(6)]
        assert o.alive
        wait_for(lambda: idle(o))
    finally:
        o.stop()


def test_last_logits_keep_one_kind_of_product_per_mode(small_engine: Any) -> None:
    engine = small_engine
    cfg = engine.model_config
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((4, cfg.hidden_size)), jnp.float32)
    per_row = np.asarray(last_logits(engine.params, rows, cfg, 1))
    for i in range(4):  # mode 1: each row its own one-row product
        alone = np.asarray(logits_of(engine.params, rows[i : i + 1], cfg))[0]
        assert same(per_row[i], alone)
    padded = np.asarray(last_logits(engine.params, rows[:1], cfg, 2))  # one row, padded to 2
    two = np.asarray(step_logits(engine.params, rows[:2], cfg))  # a 2-row decode step's product
    two = two.T if cfg.vocab_major_head else two
    assert padded.shape == (1, cfg.vocab_size) and same(padded[0], two[0])


def test_prefill_logits_fall_back_to_one_product_per_row_where_bits_depend_on_rows(
    small_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine measures whether its backend keeps a row's bits across row counts; a
    backend that does not (here: a product whose rounding depends on its row count) gets
    one product per row, so a batched prompt still has the bits of the prompt alone."""
    engine = small_engine
    assert engine._shared_row_kernel(engine.model_config) == engine._product_rows
    real = engine_module.last_logits

    def rounding_by_row_count(params: Any, rows: Any, cfg: Any, product_rows: int) -> Any:
        out = real(params, rows, cfg, product_rows)
        return out + jnp.float32(1e-6) * max(rows.shape[0], product_rows)

    monkeypatch.setattr(engine_module, "last_logits", rounding_by_row_count)
    assert engine._shared_row_kernel(engine.model_config) == 1
