"""A numpy engine with hand-computable tokens, for exact orchestrator tests and benchmarks.

It implements EngineProtocol with the real engine's slot semantics: insert
makes the prefix's token the slot's last token, generate advances only the
active slots, and a slot that would write past max_model_len raises, so an
orchestrator that overruns the context fails loudly. Token `i` of a sample
(i = 0 is the one prefill samples) is `fake_token(prompt_ids, seed, i)`.
Optional random delays per call stand in for device time.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.types import (
    MAX_LOGPROBS,
    CacheStats,
    EngineLimits,
    Prefix,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)

_MODULUS = 2**31 - 1


def prompt_hash(prompt_ids: Sequence[int]) -> int:
    return sum((i + 1) * int(t) for i, t in enumerate(prompt_ids)) % _MODULUS


def fake_token(prompt_ids: Sequence[int], seed: int, index: int, vocab_size: int = 1000) -> int:
    """The token a sample with this prompt and seed produces at position `index`."""
    return _token(prompt_hash(prompt_ids), seed, index, vocab_size)


def fake_logprob(token_id: int) -> float:
    return -0.125 * (token_id % 8)


def fake_top(token_id: int, vocab_size: int = 1000) -> list[tuple[int, float]]:
    """The MAX_LOGPROBS alternatives the fake reports for a token, best first."""
    return [((token_id + j) % vocab_size, -0.125 * j) for j in range(MAX_LOGPROBS)]


def _token(base: int, seed: int, index: int, vocab_size: int) -> int:
    return (base + 7 * seed + 13 * index + (index * index) // 3) % vocab_size


@dataclass(frozen=True)
class FakeDelays:
    """Uniform random sleeps (min s, max s) per engine call; zero by default."""

    prefill: tuple[float, float] = (0.0, 0.0)
    insert: tuple[float, float] = (0.0, 0.0)
    generate: tuple[float, float] = (0.0, 0.0)
    receive: tuple[float, float] = (0.0, 0.0)


@dataclass
class FakeState:
    """Per-slot decode state; mutated in place (the fake's form of donation)."""

    base: np.ndarray  # prompt hash
    seed: np.ndarray
    index: np.ndarray  # index of the next token to produce
    length: np.ndarray  # tokens in the slot's cache
    last: np.ndarray  # last token, not yet in the cache
    active: np.ndarray


class FakeEngine:
    def __init__(
        self,
        max_slots: int = 8,
        max_model_len: int = 256,
        prefill_buckets: tuple[int, ...] = (16, 32, 64, 128),
        vocab_size: int = 1000,
        eos_token_ids: frozenset[int] = frozenset(),
        delays: FakeDelays | None = None,
        seed: int = 0,
        max_prefill_batch: int = 1,
    ):
        self.max_slots = max_slots
        self.max_prefill_batch = max_prefill_batch
        self.max_model_len = max_model_len
        self.prefill_buckets = prefill_buckets
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._delays = delays or FakeDelays()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.prefill_calls = 0
        self.resample_calls = 0
        self.step_batches: list[int] = []  # the batch of each generate call, in call order
        self.batch_sizes: list[int] = []  # prompts per prefill call, in call order

    @property
    def max_prompt_len(self) -> int:
        return min(self.prefill_buckets[-1], self.max_model_len - 1)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_model_len, self.max_prompt_len, self.vocab_size)

    def init_state(self) -> FakeState:
        n = self.max_slots
        return FakeState(
            base=np.zeros(n, np.int64),
            seed=np.zeros(n, np.int64),
            index=np.zeros(n, np.int64),
            length=np.zeros(n, np.int64),
            last=np.zeros(n, np.int64),
            active=np.zeros(n, bool),
        )

    def cache_stats(self) -> CacheStats:
        return CacheStats()  # no prefix cache

    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_logprobs: int | None = None,
        between_chunks: Callable[[], None] | None = None,
    ) -> Prefix:
        del between_chunks  # no chunks: every prompt fits a bucket
        prefix = self._prefill_one(token_ids, sampling, prompt_logprobs)
        self._sleep(self._delays.prefill)
        self.prefill_calls += 1
        self.batch_sizes.append(1)
        return prefix

    def _prefill_one(
        self, token_ids: Sequence[int], sampling: SamplingParams, prompt_logprobs: int | None
    ) -> Prefix:
        self.limits.check(len(token_ids), None)
        bucket = self.prefill_buckets[bisect.bisect_left(self.prefill_buckets, len(token_ids))]
        base = prompt_hash(token_ids)
        echo = None
        if prompt_logprobs is not None:
            echo = [None] + [TokenLogprobs(int(t), fake_logprob(int(t))) for t in token_ids[1:]]
        return self._prefix(len(token_ids), sampling, base, bucket, echo)

    def prefill_parts(self, token_ids: Sequence[int]) -> int:
        """Every prompt fits a bucket here."""
        return 1

    def batch_fits(self, lengths: Sequence[int]) -> bool:
        """Up to max_prefill_batch prompts of one bucket, as the real engine groups them."""
        buckets = {bisect.bisect_left(self.prefill_buckets, n) for n in lengths}
        return len(lengths) <= self.max_prefill_batch and len(buckets) == 1

    def prefill_batch(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[Prefix]:
        """One call for several prompts: each Prefix as prefill alone would give it."""
        if not self.batch_fits([len(ids) for ids, _ in prompts]):
            raise ValueError(f"prompts of lengths {[len(i) for i, _ in prompts]} do not fit")
        out = [self._prefill_one(ids, sampling, None) for ids, sampling in prompts]
        self._sleep(self._delays.prefill)
        self.prefill_calls += 1
        self.batch_sizes.append(len(prompts))
        return out

    def resample(self, prefix: Prefix, sampling: SamplingParams) -> Prefix:
        self.resample_calls += 1
        base, bucket = prefix.cache
        return self._prefix(prefix.length, sampling, base, bucket, prefix.prompt_logprobs)

    def close(self) -> None:
        """Nothing to release."""

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """No prefix cache here."""
        return 0

    def receive(self, prefix: Prefix) -> Prefix:
        """Host data needs no move: only the delay of one."""
        self._sleep(self._delays.receive)
        return prefix

    def insert(self, prefix: Prefix, state: FakeState, slot: int) -> FakeState:
        self._sleep(self._delays.insert)
        base, _ = prefix.cache
        state.base[slot] = base
        state.seed[slot] = prefix.sampling.seed or 0
        state.index[slot] = 1
        state.length[slot] = prefix.length
        state.last[slot] = int(prefix.token)
        state.active[slot] = True
        return state

    def decode_bucket(self, busy_rows: int) -> int:
        if not 1 <= busy_rows <= self.max_slots:
            raise ValueError(f"busy_rows must be in 1..{self.max_slots}, got {busy_rows}")
        return min(1 << (busy_rows - 1).bit_length(), self.max_slots)

    def generate(self, state: FakeState, batch: int | None = None) -> tuple[FakeState, StepOutput]:
        """Steps slots 0..batch-1 as the real engine does; a busy slot past the batch raises
        (the real engine would leave it frozen, and its request would hang)."""
        self._sleep(self._delays.generate)
        batch = self.max_slots if batch is None else batch
        self.step_batches.append(batch)
        if batch != self.decode_bucket(batch):
            raise ValueError(f"batch {batch} is not a decode bucket")
        if state.active[batch:].any():
            left_out = (np.flatnonzero(state.active[batch:]) + batch).tolist()
            raise RuntimeError(f"busy slots {left_out} lie past the step's batch of {batch}")
        active = state.active.copy()
        overrun = active & (state.length >= self.max_model_len)
        if overrun.any():
            raise RuntimeError(f"slots {np.flatnonzero(overrun).tolist()} ran past the context")
        tokens = (
            state.base + 7 * state.seed + 13 * state.index + (state.index * state.index) // 3
        ) % self.vocab_size
        tokens = np.where(active, tokens, 0)
        state.length += active
        state.index += active
        state.last = np.where(active, tokens, state.last)
        offsets = np.arange(MAX_LOGPROBS)
        output = StepOutput(
            tokens=tokens.astype(np.int32),
            logprobs=(-0.125 * (tokens % 8)).astype(np.float32),
            top_ids=((tokens[:, None] + offsets) % self.vocab_size).astype(np.int32),
            top_logprobs=np.broadcast_to(-0.125 * offsets, (self.max_slots, MAX_LOGPROBS)),
            active=active,
        )
        return state, output

    def free(self, state: FakeState, slot: int) -> FakeState:
        state.active[slot] = False
        return state

    def set_masks(self, state: FakeState, slots: Any, allowed: Any) -> FakeState:
        """Masks change nothing here: fake tokens follow their formula, not a grammar."""
        return state

    def _prefix(
        self,
        length: int,
        sampling: SamplingParams,
        base: int,
        bucket: int,
        echo: list[TokenLogprobs | None] | None,
    ) -> Prefix:
        token = _token(base, sampling.seed or 0, 0, self.vocab_size)
        top = fake_top(token, self.vocab_size)
        return Prefix(
            length=length,
            sampling=sampling,
            token=np.int32(token),
            logprob=np.float32(fake_logprob(token)),
            top_ids=np.array([i for i, _ in top], np.int32),
            top_logprobs=np.array([p for _, p in top], np.float32),
            cache=(base, bucket),
            last_logits=None,
            prompt_logprobs=echo,
        )

    def _sleep(self, bounds: tuple[float, float]) -> None:
        low, high = bounds
        if high <= 0:
            return
        with self._rng_lock:
            seconds = self._rng.uniform(low, high)
        time.sleep(seconds)


def fake_text(token_id: int) -> str:
    """The text the fake detokenizer gives a token."""
    return f"<{token_id}>"


class FakeTokenizer:
    """Just what the orchestrator reads of a tokenizer, plus a fake_text detokenizer factory."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(), delay_s: float = 0.0):
        self.eos_token_ids = eos_token_ids
        self.delay_s = delay_s  # max random sleep per detokenized token
        self.special_token_ids: frozenset[int] = frozenset()

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(fake_text(t) for t in token_ids)

    def detokenizer(
        self, prompt_ids: tuple[int, ...], skip_special_tokens: bool
    ) -> FakeDetokenizer:
        return FakeDetokenizer(self.delay_s)


class FakeDetokenizer:
    """Turns each token into fake_text(token); may sleep to mimic a slow detokenizer."""

    def __init__(self, delay_s: float = 0.0):
        self._delay_s = delay_s

    def add(self, token_id: int) -> str:
        if self._delay_s > 0:
            time.sleep(random.uniform(0.0, self._delay_s))
        return fake_text(token_id)

    def flush(self) -> str:
        return ""
