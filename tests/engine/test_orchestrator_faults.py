"""The orchestrator when things go wrong: aborts, overload, stage faults, shutdown."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from engine.fake import FakeDelays, FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    Overloaded,
    RequestFailed,
    Unavailable,
)
from engine.request import ActiveRequest, RequestStream
from engine.stages.detokenize import text_streams
from engine.types import Prefix, SamplingParams


class GatedEngine(FakeEngine):
    """A fake engine whose prefill waits for a gate, to hold requests in known places."""

    def __init__(self, **kw: object):
        super().__init__(**kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.prefilled: list[tuple[int, ...]] = []

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        self.gate.wait(10)
        self.prefilled.append(tuple(token_ids))
        return super().prefill(token_ids, sampling, **kw)


def make(engine: FakeEngine, config: OrchestratorConfig | None = None) -> Orchestrator:
    tokenizer = FakeTokenizer()
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids), config)
    o.start()
    return o


def request(rid: str, prompt: tuple[int, ...], max_tokens: int | None = 8) -> ActiveRequest:
    return ActiveRequest(rid, prompt, SamplingParams(temperature=0.0, seed=0), max_tokens)


def tokens(stream: RequestStream) -> list[int]:
    return [t for d in stream.collect(timeout=10) for t in d.token_ids]


def wait_for(predicate: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def idle(o: Orchestrator) -> bool:
    s = o.stats()
    return (s.slots_in_use, s.running_requests, s.queued_requests, s.prefill_queue_depth) == (
        0,
        0,
        0,
        0,
    )


def test_abort_of_a_queued_request_drops_it_before_prefill() -> None:
    engine = GatedEngine(max_slots=2)
    o = make(engine)
    try:
        first = o.submit(request("first", (1,)))
        wait_for(lambda: o.stats().queued_requests == 0)  # the prefill thread holds "first"
        queued = o.submit(request("queued", (2,)))
        assert o.stats().queued_requests == 1
        o.abort("queued")
        o.abort("queued")  # idempotent
        assert queued.aborted and queued.collect(timeout=1) == []
        engine.gate.set()
        assert tokens(first) == [fake_token((1,), 0, i) for i in range(8)]
        wait_for(lambda: idle(o))
        assert engine.prefilled == [(1,)]
    finally:
        o.stop()


def test_abort_of_a_running_request_frees_its_slot_and_spares_the_others() -> None:
    engine = FakeEngine(max_slots=4, delays=FakeDelays(generate=(0.02, 0.02)))
    o = make(engine)
    try:
        long = o.submit(request("long", (1,), max_tokens=None))
        other = o.submit(request("other", (2,), max_tokens=12))
        seen = iter(long)
        next(seen)  # running: it has a slot and has produced its first token
        next(seen)
        o.abort("long")
        steps_at_abort = o.stats().generate_steps
        wait_for(lambda: o.stats().slots_in_use <= 1, timeout=1.0)
        assert o.stats().generate_steps - steps_at_abort <= 2  # freed within a step or so
        assert long.aborted and long.error is None
        assert tokens(other) == [fake_token((2,), 0, i) for i in range(12)]
        wait_for(lambda: idle(o))
        o.abort("long")  # finished and aborted already: no-op
        o.abort("other")
        o.abort("never-existed")
        assert o.alive
    finally:
        o.stop()


def test_fifty_aborts_in_random_states_leave_nothing_running() -> None:
    rng = random.Random(7)
    engine = FakeEngine(
        max_slots=8,
        delays=FakeDelays(prefill=(0, 0.002), generate=(0.0002, 0.001)),
        seed=7,
    )
    o = make(engine, OrchestratorConfig(max_queued_samples=128, prefill_queue_size=2))
    try:
        streams = {}
        for i in range(100):
            prompt = (i + 1, rng.randrange(1000))
            streams[f"r{i}"] = (prompt, o.submit(request(f"r{i}", prompt, rng.randint(1, 40))))
        victims = rng.sample(sorted(streams), 50)
        for rid in victims:
            time.sleep(rng.uniform(0, 0.004))
            o.abort(rid)
        states = set()
        for rid, (prompt, stream) in streams.items():
            deltas = stream.collect(timeout=10)
            got = [t for d in deltas for t in d.token_ids]
            assert got == [fake_token(prompt, 0, i) for i in range(len(got))]
            if stream.aborted:
                assert rid in victims and not (deltas and deltas[-1].finish_reason)
                states.add("running" if deltas else "before its first token")
            else:
                assert deltas[-1].finish_reason == "length"
                states.add("finished")
        assert len(states) == 3  # aborts hit queued/prefilling, running and finished requests
        wait_for(lambda: idle(o))
        assert o.alive
    finally:
        o.stop()


def test_submit_beyond_the_queue_bound_raises_overloaded_at_once() -> None:
    engine = GatedEngine(max_slots=2)
    o = make(engine, OrchestratorConfig(max_queued_samples=3))
    try:
        admitted = [o.submit(request("r0", (1,)))]
        wait_for(lambda: o.stats().queued_requests == 0)  # r0 is inside prefill
        admitted += [o.submit(request(f"r{i}", (i + 1,))) for i in range(1, 4)]
        started = time.monotonic()
        with pytest.raises(Overloaded) as info:
            o.submit(request("r4", (5,)))
        assert time.monotonic() - started < 0.1
        assert info.value.queued == 3 and info.value.retry_after_s > 0
        engine.gate.set()
        for i, stream in enumerate(admitted):
            assert tokens(stream) == [fake_token((i + 1,), 0, k) for k in range(8)]
        assert tokens(o.submit(request("r4", (5,)))) == [fake_token((5,), 0, k) for k in range(8)]
    finally:
        o.stop()


@pytest.mark.parametrize(
    "fault", ["prefill:after=6", "generate:after=5", "detokenize:after=5", "generate"]
)
def test_a_stage_fault_fails_every_open_stream_within_a_second(fault: str) -> None:
    engine = FakeEngine(
        max_slots=4, delays=FakeDelays(prefill=(0.001, 0.002), generate=(0.001, 0.001))
    )
    o = make(engine, OrchestratorConfig(fault_injection=fault))
    failures: list[BaseException] = []
    o.add_failure_listener(failures.append)
    try:
        streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=None)) for i in range(10)]
        assert o.wait_dead(timeout=1.0)
        started = time.monotonic()
        for stream in streams:
            with pytest.raises(RequestFailed, match=fault.split(":")[0]):
                stream.collect(timeout=1.0)
        assert time.monotonic() - started < 1.0
        assert not o.alive and len(failures) == 1 and o.error is failures[0]
        assert not o.stats().alive
        with pytest.raises(Unavailable):
            o.submit(request("late", (1,)))
        late: list[BaseException] = []
        o.add_failure_listener(late.append)  # registered after the fault: called at once
        assert late == failures
    finally:
        o.stop()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("orch"))


def test_a_stage_fault_fails_async_consumers_too() -> None:
    import asyncio

    o = make(FakeEngine(max_slots=2), OrchestratorConfig(fault_injection="generate:after=3"))

    async def consume() -> None:
        stream = o.submit(request("a", (1,), max_tokens=None))
        async for _ in stream:
            pass

    try:
        with pytest.raises(RequestFailed):
            asyncio.run(asyncio.wait_for(consume(), timeout=1.0))
    finally:
        o.stop()


def test_drain_lets_open_requests_finish_and_refuses_new_ones() -> None:
    o = make(FakeEngine(max_slots=2, delays=FakeDelays(generate=(0.001, 0.001))))
    streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=10)) for i in range(5)]
    result: list[bool] = []
    drainer = threading.Thread(target=lambda: result.append(o.drain(timeout=5)))
    drainer.start()
    wait_for(lambda: o.stats().draining)
    with pytest.raises(Unavailable):
        o.submit(request("late", (9,)))
    drainer.join()
    assert result == [True]
    for i, stream in enumerate(streams):
        assert tokens(stream) == [fake_token((i + 1,), 0, k) for k in range(10)]
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("orch"))


def test_drain_timeout_fails_the_requests_still_open() -> None:
    o = make(FakeEngine(max_slots=2, delays=FakeDelays(generate=(0.002, 0.002))))
    streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=None)) for i in range(4)]
    started = time.monotonic()
    assert o.drain(timeout=0.2) is False
    assert time.monotonic() - started < 2.0
    for stream in streams:
        with pytest.raises(RequestFailed):
            stream.collect(timeout=1)
