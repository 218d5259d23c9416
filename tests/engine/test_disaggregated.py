"""Disaggregated mode on fake engines: a transfer stage between prefill and generate.

Every sample's first token rides from prefill through the transfer stage to the
generate stage and then the one detokenize queue; random delays in every stage
must never reorder or lose a token. Aborts, faults and drain behave as in
interleaved mode. (The real engines on separate CPU devices:
tests/engine/test_disaggregated_real.py.)
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from engine.fake import FakeDelays, FakeEngine, FakeTokenizer, fake_text, fake_token
from engine.orchestrator import Orchestrator, OrchestratorConfig, RequestFailed, Unavailable
from engine.request import ActiveRequest, RequestStream
from engine.stages.detokenize import text_streams
from engine.types import Prefix, SamplingParams


class Counting(FakeEngine):
    """A fake engine that counts which of its calls were made."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.calls: dict[str, int] = {"prefill": 0, "receive": 0, "generate": 0}

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        self.calls["prefill"] += 1
        return super().prefill(token_ids, sampling, **kw)

    def receive(self, prefix: Prefix) -> Prefix:
        self.calls["receive"] += 1
        return super().receive(prefix)

    def generate(self, state: Any, batch: int | None = None) -> Any:
        self.calls["generate"] += 1
        return super().generate(state, batch)


def make(
    prefill: FakeEngine, generate: FakeEngine, config: OrchestratorConfig | None = None
) -> Orchestrator:
    tokenizer = FakeTokenizer(delay_s=0.0002)
    o = Orchestrator(
        generate,
        text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids),
        config,
        prefill_engine=prefill,
    )
    o.start()
    return o


def request(rid: str, prompt: tuple[int, ...], seed: int = 0, **kw: Any) -> ActiveRequest:
    sampling = SamplingParams(temperature=0.0, seed=seed)
    return ActiveRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, **kw)


def tokens(stream: RequestStream, timeout: float = 10) -> list[int]:
    return [t for d in stream.collect(timeout=timeout) for t in d.token_ids]


def idle(o: Orchestrator) -> bool:
    s = o.stats()
    busy = (s.slots_in_use, s.running_requests, s.queued_requests, s.prefill_queue_depth)
    return busy == (0, 0, 0, 0) and s.transfer_queue_depth == 0


def wait_for(predicate: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def delays(prefill: float = 0.002) -> FakeDelays:
    return FakeDelays(
        prefill=(0, prefill), insert=(0, 0.0005), generate=(0, 0.001), receive=(0, 0.003)
    )


@pytest.mark.parametrize("run", range(3))
def test_every_token_arrives_in_order_under_random_stage_delays(run: int) -> None:
    rng = random.Random(run)
    prefill = Counting(max_slots=8, delays=delays(), seed=run)
    generate = Counting(max_slots=8, delays=delays(), seed=run)
    o = make(prefill, generate, OrchestratorConfig(prefill_queue_size=3))
    try:
        cases = []
        for i in range(150):
            prompt = tuple(rng.randrange(1000) for _ in range(rng.randint(1, 40)))
            cases.append((f"r{i}", prompt, rng.randrange(2**31), rng.randint(1, 20)))
        streams = {rid: o.submit(request(rid, p, s, max_tokens=m)) for rid, p, s, m in cases}
        for rid, prompt, seed, max_tokens in cases:
            deltas = streams[rid].collect(timeout=30)
            want = [fake_token(prompt, seed, i) for i in range(max_tokens)]
            assert [t for d in deltas for t in d.token_ids] == want, rid
            assert "".join(d.text for d in deltas) == "".join(fake_text(t) for t in want)
            assert [d.completion_tokens for d in deltas] == list(range(1, max_tokens + 1))
            assert deltas[-1].finish_reason == "length"
        wait_for(lambda: idle(o))
    finally:
        o.stop()
    # each engine did its own part only: every prefill on one, every step on the other
    assert prefill.calls["prefill"] == len(cases) and prefill.calls["generate"] == 0
    assert generate.calls["prefill"] == 0 and generate.calls["receive"] == len(cases)
    assert generate.calls["generate"] > 0


def test_the_transfer_backlog_is_a_queue_depth_gauge() -> None:
    slow = FakeDelays(receive=(0.05, 0.05))
    o = make(FakeEngine(max_slots=4), FakeEngine(max_slots=4, delays=slow))
    try:
        streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=2)) for i in range(4)]
        wait_for(lambda: o.stats().transfer_queue_depth > 0)
        for i, stream in enumerate(streams):
            assert tokens(stream) == [fake_token((i + 1,), 0, k) for k in range(2)]
        wait_for(lambda: idle(o))
    finally:
        o.stop()


def test_aborts_in_random_states_leave_nothing_running() -> None:
    rng = random.Random(11)
    o = make(
        FakeEngine(max_slots=8, delays=delays(0.003), seed=1),
        FakeEngine(max_slots=8, delays=delays(), seed=1),
        OrchestratorConfig(max_queued_samples=128, prefill_queue_size=2),
    )
    try:
        streams = {}
        for i in range(80):
            prompt = (i + 1, rng.randrange(1000))
            streams[f"r{i}"] = (prompt, o.submit(request(f"r{i}", prompt, max_tokens=30)))
        victims = rng.sample(sorted(streams), 40)
        for rid in victims:
            time.sleep(rng.uniform(0, 0.004))
            o.abort(rid)
        for rid, (prompt, stream) in streams.items():
            deltas = stream.collect(timeout=10)
            got = [t for d in deltas for t in d.token_ids]
            assert got == [fake_token(prompt, 0, i) for i in range(len(got))]
            assert stream.aborted == (rid in victims) or deltas[-1].finish_reason == "length"
        wait_for(lambda: idle(o))
        assert o.alive
    finally:
        o.stop()


@pytest.mark.parametrize("fault", ["transfer:after=3", "transfer", "prefill:after=2"])
def test_a_stage_fault_fails_every_open_stream(fault: str) -> None:
    o = make(
        FakeEngine(max_slots=4, delays=FakeDelays(prefill=(0.001, 0.002))),
        FakeEngine(max_slots=4, delays=FakeDelays(generate=(0.001, 0.001))),
        OrchestratorConfig(fault_injection=fault),
    )
    try:
        streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=None)) for i in range(10)]
        assert o.wait_dead(timeout=1.0)
        for stream in streams:
            with pytest.raises(RequestFailed, match=fault.split(":")[0]):
                stream.collect(timeout=1.0)
        with pytest.raises(Unavailable):
            o.submit(request("late", (1,)))
    finally:
        o.stop()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("orch"))


def test_drain_lets_open_requests_finish() -> None:
    o = make(FakeEngine(max_slots=2), FakeEngine(max_slots=2, delays=delays()))
    streams = [o.submit(request(f"r{i}", (i + 1,), max_tokens=10)) for i in range(5)]
    assert o.drain(timeout=5) is True
    for i, stream in enumerate(streams):
        assert tokens(stream) == [fake_token((i + 1,), 0, k) for k in range(10)]
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("orch"))
