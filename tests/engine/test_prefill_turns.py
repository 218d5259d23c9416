"""Prefill calls and decode steps take turns on shared devices (StepClock).

A prefill call starts once the decode step owed to the running streams has finished,
no step is dispatched while a call runs, a call's samples are in their slots before
the next step, and the prefill stage waits for its call before taking the next prompts.
The fake engine's outputs here are "device values" that log when they are waited for,
so the order of dispatches and waits is checked exactly.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.fake import FakeDelays, FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.stages.queues import StepClock
from engine.types import Prefix, SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)


class Pending:
    """A device value named `name`: ready once waited for (logged the first time)."""

    def __init__(self, value: Any, name: str, log: list[str], lock: threading.Lock):
        self.value, self.name, self._log, self._lock = value, name, log, lock

    def block_until_ready(self) -> Pending:
        with self._lock:
            if f"ready {self.name}" not in self._log:
                self._log.append(f"ready {self.name}")
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.value, dtype)

    def __int__(self) -> int:
        return int(self.value)


class LoggingEngine(FakeEngine):
    """Logs "prefill K" at each prefill dispatch, "insert prefill K" as its samples go into
    slots and "step N" at each step; their outputs log "ready ..." when waited for."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.calls = 0
        self.steps_taken = 0

    def _pending(self, prefixes: list[Prefix]) -> list[Prefix]:
        with self.lock:
            name = f"prefill {self.calls}"
            self.calls += 1
            self.log.append(name)
        return [
            dataclasses.replace(p, token=Pending(int(p.token), name, self.log, self.lock))
            for p in prefixes
        ]

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        return self._pending([super().prefill(token_ids, sampling, **kw)])[0]

    def prefill_batch(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[Prefix]:
        return self._pending(super().prefill_batch(prompts))

    def insert(self, prefix: Prefix, state: Any, slot: int) -> Any:
        with self.lock:
            self.log.append(f"insert {prefix.token.name}")
        return super().insert(prefix, state, slot)

    def generate(self, state: Any, batch: int | None = None) -> Any:
        with self.lock:
            name = f"step {self.steps_taken}"
            self.steps_taken += 1
            self.log.append(name)
        state, out = super().generate(state, batch)
        tokens = Pending(out.tokens, name, self.log, self.lock)
        return state, dataclasses.replace(out, tokens=tokens)


class Output:
    def __init__(self, name: str, log: list[str]):
        self.name, self._log = name, log

    def block_until_ready(self) -> Output:
        self._log.append(self.name)
        return self


def test_a_prefill_call_waits_for_the_step_owed_and_holds_steps_while_it_runs() -> None:
    stop = threading.Event()
    clock = StepClock()
    log: list[str] = []
    clock.prefill_turn(stop)  # nothing decodes: the call goes at once
    assert not clock.begin_step(stop)  # and no step while it runs
    clock.prefill_ended()
    assert clock.begin_step(stop)
    clock.stepped(Output("s0", log))  # decoding now
    clock.prefill_turn(stop)  # s0 began after the last call ended: owed, and waited for
    assert log == ["s0"]
    assert not clock.begin_step(stop)
    clock.prefill_ended()

    waiting = threading.Thread(target=clock.prefill_turn, args=(stop,))
    waiting.start()  # no step since the last call: this one waits for one
    time.sleep(0.2)
    assert waiting.is_alive() and log == ["s0"]
    assert clock.begin_step(stop)  # the step owed goes, then no other before the call
    assert not clock.begin_step(stop)
    clock.stepped(Output("s1", log))
    waiting.join(timeout=2)
    assert not waiting.is_alive() and log == ["s0", "s1"]
    assert not clock.begin_step(stop)
    clock.prefill_ended()
    assert clock.begin_step(stop)


def test_a_call_beside_the_steps_still_waits_for_the_step_owed_but_holds_none() -> None:
    stop = threading.Event()
    clock = StepClock()
    log: list[str] = []
    assert clock.begin_step(stop)
    clock.stepped(Output("s0", log))
    clock.prefill_turn(stop, hold=False)  # a long prompt's first chunk: s0 is owed
    assert log == ["s0"]
    assert clock.begin_step(stop)  # steps go on beside it
    clock.stepped(Output("s1", log))
    clock.prefill_ended()
    waiting = threading.Thread(target=clock.prefill_turn, args=(stop, False))
    waiting.start()  # the next chunk: after one more step (s1 began before the chunk ended)
    time.sleep(0.2)
    assert waiting.is_alive()
    assert clock.begin_step(stop)
    assert not clock.begin_step(stop)  # only the one owed, while the chunk waits
    clock.stepped(Output("s2", log))
    waiting.join(timeout=2)
    assert not waiting.is_alive() and log == ["s0", "s2"]
    assert clock.begin_step(stop)


def test_a_step_is_not_begun_past_a_call_that_ended_after_the_inbox_was_read() -> None:
    """The generate thread reads calls_ended, then its inbox; a call that ends between
    the two handed its samples on before ending, so the step must wait for them."""
    stop = threading.Event()
    clock = StepClock()
    seen = clock.calls_ended
    clock.prefill_turn(stop)  # the prefill thread: a call, its samples handed on, ended
    clock.prefill_ended()
    started = time.monotonic()
    assert not clock.begin_step(stop, seen)  # back to the inbox, without waiting
    assert time.monotonic() - started < StepClock.WAIT_S / 2
    assert clock.begin_step(stop, clock.calls_ended)


def test_nothing_waits_while_decoding_is_idle_or_prefill_has_its_own_devices() -> None:
    stop = threading.Event()
    log: list[str] = []
    clock = StepClock()
    assert clock.begin_step(stop)
    clock.stepped(Output("s0", log))
    clock.prefill_ended()  # without a call: changes nothing
    clock.idle()  # no slot busy: no step is coming, so none is owed
    started = time.monotonic()
    clock.prefill_turn(stop)
    clock.prefill_ended()
    clock.prefill_turn(stop)
    assert time.monotonic() - started < StepClock.WAIT_S / 2
    clock.prefill_ended()

    own = StepClock(shared=False)
    assert own.begin_step(stop)
    own.stepped(Output("t0", log))
    own.prefill_turn(stop)  # decoding, but on other devices: no wait, no step held
    assert own.begin_step(stop) and log == ["s0"]


def run_burst(engine: LoggingEngine, running: int, burst: int) -> None:
    """`running` long requests decode while `burst` short ones arrive at once."""
    tokenizer = FakeTokenizer()
    orch = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    orch.start()
    try:
        prompts = [tuple(range(1 + i, 6 + i)) for i in range(running + burst)]
        lengths = [40] * running + [6] * burst
        streams = []
        for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
            if i == running:  # the burst comes while the others decode
                while engine.steps_taken < 3:
                    time.sleep(0.001)
            sampling = SamplingParams(temperature=0.0, seed=i)
            request = ActiveRequest(f"r{i}", prompt, sampling, max_tokens=length)
            streams.append(orch.submit(request))
        results = [[t for d in s.collect(timeout=30) for t in d.token_ids] for s in streams]
    finally:
        orch.stop()
    pairs = enumerate(zip(prompts, lengths, strict=True))
    want = [[fake_token(p, i, k) for k in range(n)] for i, (p, n) in pairs]
    assert results == want


def test_prefill_calls_and_steps_take_turns_and_tokens_stay_exact() -> None:
    delays = FakeDelays(prefill=(0.002, 0.006), generate=(0.001, 0.003))
    engine = LoggingEngine(max_slots=16, max_prefill_batch=3, delays=delays)
    run_burst(engine, running=2, burst=10)
    log = list(engine.log)
    calls = [i for i, entry in enumerate(log) if entry.startswith("prefill ")]
    assert len(calls) >= 4  # the burst went out as several calls
    for k, at in enumerate(calls):
        ready = log.index(f"ready prefill {k}")
        running = log[at:ready]
        assert not [e for e in running if e.startswith("step ")], (k, running)  # ran alone
        if k == 0:
            continue
        before = [e for e in log[calls[k - 1] : at] if e.startswith("step ")]
        assert before, (k, log[calls[k - 1] : at + 1])  # the streams got a step in between
        assert f"ready {before[-1]}" in log[:at], (k, log[calls[k - 1] : at + 1])  # done first
        inserted = [i for i, e in enumerate(log) if e == f"insert prefill {k - 1}"]
        assert inserted and max(inserted) < log.index(before[0]), (k, log[calls[k - 1] : at])


class ChunkingEngine(LoggingEngine):
    """Prompts longer than CHUNKED take three calls, logged "chunk K.i" when dispatched and
    "ready chunk K.i" when done (each ~10 ms on the prefill thread, its "device")."""

    CHUNKED = 20

    def prefill_parts(self, token_ids: Sequence[int]) -> int:
        return 3 if len(token_ids) > self.CHUNKED else 1

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        between = kw.pop("between_chunks", None)
        if self.prefill_parts(token_ids) == 1:
            return super().prefill(token_ids, sampling, **kw)
        with self.lock:
            call = self.calls
            self.calls += 1
        for part in range(3):
            if part:
                between()
            with self.lock:
                self.log.append(f"chunk {call}.{part}")
            time.sleep(0.01)
            with self.lock:
                self.log.append(f"ready chunk {call}.{part}")
        prefix = FakeEngine.prefill(self, token_ids, sampling, **kw)
        token = Pending(int(prefix.token), f"chunk {call}.2", self.log, self.lock)
        return dataclasses.replace(prefix, token=token)


def test_a_long_prompt_s_chunks_run_beside_the_steps_with_one_between_two() -> None:
    delays = FakeDelays(generate=(0.001, 0.002))
    engine = ChunkingEngine(max_slots=8, delays=delays)
    tokenizer = FakeTokenizer()
    orch = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    orch.start()
    try:
        running = orch.submit(ActiveRequest("running", (1, 2, 3), GREEDY, max_tokens=200))
        while engine.steps_taken < 3:
            time.sleep(0.001)
        long_prompt = tuple(range(5, 5 + 2 * ChunkingEngine.CHUNKED))
        long = orch.submit(ActiveRequest("long", long_prompt, GREEDY, max_tokens=4))
        got = [[t for d in s.collect(timeout=30) for t in d.token_ids] for s in (running, long)]
    finally:
        orch.stop()
    assert got == [
        [fake_token((1, 2, 3), 0, k) for k in range(200)],
        [fake_token(long_prompt, 0, k) for k in range(4)],
    ]
    log = list(engine.log)
    for part in range(3):
        start, ready = log.index(f"chunk 1.{part}"), log.index(f"ready chunk 1.{part}")
        beside = [e for e in log[start:ready] if e.startswith("step ")]
        assert beside, (part, log[start : ready + 1])  # steps went on during the chunk
        if part:
            before = [e for e in log[:start] if e.startswith("step ")][-1]
            assert f"ready {before}" in log[:start]  # and one finished before it
