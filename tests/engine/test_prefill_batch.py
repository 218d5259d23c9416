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
    candidates = engine_module.prefill_batch_shapes(engine.prefill_buckets, 16, 2048)
    assert candidates == ((2, 16), (2, 64), (4, 64), (8, 64), (16, 64))
    kept = engine.prefill_batch_shapes  # what warm-up measured to keep a prompt's bits
    assert set(kept) <= set(candidates) and {(8, 64), (16, 64)} <= set(kept)
    assert engine.max_prefill_batch == 16
    assert engine.batch_fits([40, 50, 33, 63])  # one bucket (64)
    assert engine.batch_fits([5, 12]) == ((2, 16) in kept)  # two short ones, where exact
    assert not engine.batch_fits([5, 12, 3])  # 3 x 16 rows would take the other kernel
    assert not engine.batch_fits([5, 40])  # buckets 16 and 64: padding would waste work
    assert not engine.batch_fits([40] * 17)  # more rows than compiled
    with pytest.raises(ValueError, match="do not fit"):
        engine.prefill_batch([([1] * 5, SAMPLINGS[0]), ([1] * 40, SAMPLINGS[0])])


def test_warm_up_drops_the_batch_shapes_where_a_prompt_s_bits_differ(
    small_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = small_engine
    monkeypatch.setattr(engine, "prefill_batch_shapes", engine.prefill_batch_shapes)
    monkeypatch.setattr(engine, "max_prefill_batch", engine.max_prefill_batch)
    real = engine._prefill_many

    def four_rows_round_otherwise(params: Any, tokens: Any, *args: Any) -> Any:
        out = real(params, tokens, *args)
        if tokens.shape[0] == 4:
            for row in out["rows"]:
                row["last_logits"] = row["last_logits"] + jnp.float32(1e-6)
        return out

    monkeypatch.setattr(engine, "_prefill_many", four_rows_round_otherwise)
    before = engine.prefill_batch_shapes
    engine._keep_exact_batch_shapes(SamplingParams(temperature=0.0, seed=0))
    assert engine.prefill_batch_shapes == tuple(s for s in before if s[0] != 4)
    assert engine.batch_fits([40] * 3)  # padded to the 8-row shape instead
    sampling = SamplingParams(temperature=0.0, seed=0)
    prompts = [[(5 * r + i) % 300 for i in range(40 + r)] for r in range(3)]
    batched = engine.prefill_batch([(p, sampling) for p in prompts])
    for prompt, prefix in zip(prompts, batched, strict=True):
        assert_same_prefix(prefix, engine.prefill(prompt, sampling))


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
        held.append(o.submit(request("echo", (3,), prompt_logprobs=0)))  # needs all logits
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
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((8, cfg.hidden_size)), jnp.float32)
    per_row = np.asarray(last_logits(engine.params, rows[:4], cfg, 1))
    for i in range(4):  # mode 1: each row its own one-row product
        alone = np.asarray(logits_of(engine.params, rows[i : i + 1], cfg))[0]
        assert same(per_row[i], alone)
    padded = np.asarray(last_logits(engine.params, rows[:1], cfg, 2))  # one row, padded to 2
    two = np.asarray(step_logits(engine.params, rows[:2], cfg))  # a 2-row decode step's product
    two = two.T if cfg.vocab_major_head else two
    assert padded.shape == (1, cfg.vocab_size) and same(padded[0], two[0])
    grouped = np.asarray(last_logits(engine.params, rows, cfg, 4))  # 8 rows: 2 products of 4
    assert grouped.shape == (8, cfg.vocab_size)
    for start in (0, 4):
        group = np.asarray(step_logits(engine.params, rows[start : start + 4], cfg))
        group = group.T if cfg.vocab_major_head else group
        assert same(grouped[start : start + 4], group)


def rounding_by_rows(limit: int) -> Any:
    """last_logits on a backend that rounds a product of more than `limit` rows otherwise."""
    real = engine_module.last_logits

    def product(params: Any, rows: Any, cfg: Any, product_rows: int) -> Any:
        out = real(params, rows, cfg, product_rows)
        size = max(2, min(rows.shape[0], product_rows))  # the rows of each product
        return out + jnp.float32(1e-6) * (size > limit)

    return product


def test_prefill_logits_take_products_of_as_many_rows_as_keep_their_bits(
    small_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine measures up to how many rows a product keeps a row's bits on its
    backend and never takes more (engine.model.last_logits splits larger batches)."""
    engine = small_engine
    assert engine._shared_row_kernel(engine.model_config) == engine._product_rows
    monkeypatch.setattr(engine_module, "last_logits", rounding_by_rows(4))
    assert engine._shared_row_kernel(engine.model_config) == 4
    monkeypatch.setattr(engine_module, "last_logits", rounding_by_rows(2))
    assert engine._shared_row_kernel(engine.model_config) == 2


def test_a_batch_split_into_several_logits_products_keeps_each_prompt_s_bits(
    tiny_checkpoint_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 8 prompts on an engine whose products take at most 2 rows: four
    products, and every prompt's Prefix as alone."""
    from engine.engine import Engine, EngineConfig

    monkeypatch.setattr(Engine, "_shared_row_kernel", lambda self, cfg: 2)
    engine = Engine(
        EngineConfig(
            tiny_checkpoint_of("llama"), max_slots=2, max_model_len=64, max_prefill_batch=8
        )
    )
    assert engine._product_rows == 2
    sampling = SamplingParams(temperature=0.0, seed=0)
    prompts = [[(11 * r + i) % 300 for i in range(40 + r)] for r in range(8)]
    batched = engine.prefill_batch([(p, sampling) for p in prompts])
    for prompt, prefix in zip(prompts, batched, strict=True):
        assert_same_prefix(prefix, engine.prefill(prompt, sampling))
