"""A request's bad data fails that request alone; admission counts samples; seeds pass unchanged."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from engine.fake import FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator, OrchestratorConfig, Overloaded
from engine.request import ActiveRequest, RequestRejected
from engine.stages.detokenize import text_streams
from engine.types import Prefix, SamplingParams
from tests.engine.test_orchestrator_faults import idle, tokens, wait_for

POISON = (666,)


class PickyEngine(FakeEngine):
    """Fails to convert one prompt's data (as an int32 overflow did) and records seeds."""

    def __init__(self, **kw: object):
        super().__init__(**kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.gate.set()
        self.seeds: list[int | None] = []
        self.fail_resample_at: int | None = None

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        self.gate.wait(10)
        self.seeds.append(sampling.seed)
        if tuple(token_ids) == POISON:
            raise OverflowError("Python int too large to convert to C int")
        return super().prefill(token_ids, sampling, **kw)

    def resample(self, prefix: Prefix, sampling: SamplingParams) -> Prefix:
        self.seeds.append(sampling.seed)
        if self.fail_resample_at is not None and len(self.seeds) > self.fail_resample_at:
            raise ValueError("cannot convert this sample's parameters")
        return super().resample(prefix, sampling)


def make(engine: FakeEngine, config: OrchestratorConfig | None = None) -> Orchestrator:
    tokenizer = FakeTokenizer()
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids), config)
    o.start()
    return o


def request(
    rid: str, prompt: tuple[int, ...], *, n: int = 1, seed: int = 0, temperature: float = 0.0
) -> ActiveRequest:
    sampling = SamplingParams(temperature=temperature, seed=seed)
    return ActiveRequest(rid, prompt, sampling, max_tokens=6, n=n)


def test_a_request_the_engine_cannot_convert_fails_alone() -> None:
    engine = PickyEngine(max_slots=2)
    o = make(engine)
    try:
        before = o.submit(request("before", (1, 2)))
        poisoned = o.submit(request("poisoned", POISON))
        after = o.submit(request("after", (3,)))
        with pytest.raises(RequestRejected, match="too large"):
            tokens(poisoned)
        assert tokens(before) == [fake_token((1, 2), 0, k) for k in range(6)]
        assert tokens(after) == [fake_token((3,), 0, k) for k in range(6)]
        assert o.alive
        wait_for(lambda: idle(o))
    finally:
        o.stop()


def test_a_sample_that_fails_to_resample_gives_back_every_slot() -> None:
    engine = PickyEngine(max_slots=4)
    engine.fail_resample_at = 2  # samples 0 and 1 reach the generate stage, sample 2 fails
    o = make(engine)
    try:
        stream = o.submit(request("n3", (5,), n=3, temperature=1.0))
        with pytest.raises(RequestRejected):
            tokens(stream)
        wait_for(lambda: idle(o))
        engine.fail_resample_at = None
        assert tokens(o.submit(request("next", (6,)))) == [fake_token((6,), 0, k) for k in range(6)]
        assert o.alive
    finally:
        o.stop()


def test_admission_counts_samples_not_requests() -> None:
    engine = PickyEngine(max_slots=2)
    engine.gate.clear()
    o = make(engine, OrchestratorConfig(max_queued_samples=4))
    try:
        held = [o.submit(request("held", (1,)))]  # taken by the prefill thread, gated
        wait_for(lambda: o.stats().queued_requests == 0)
        held.append(o.submit(request("three", (2,), n=3, temperature=1.0)))
        with pytest.raises(Overloaded) as info:
            o.submit(request("two", (3,), n=2, temperature=1.0))
        assert info.value.queued == 3
        held.append(o.submit(request("one", (4,))))  # 3 + 1 fits the bound of 4
        with pytest.raises(ValueError, match="max_queued_samples=4"):
            o.submit(request("five", (5,), n=5, temperature=1.0))  # could never be admitted
        engine.gate.set()
        for stream in held:
            assert len(tokens(stream)) == 6 * stream.n
        wait_for(lambda: idle(o))
    finally:
        o.stop()


def test_retry_after_is_derived_from_the_backlog() -> None:
    retries = {}
    for bound in (2, 20):
        engine = PickyEngine(max_slots=2)
        engine.gate.clear()
        o = make(engine, OrchestratorConfig(max_queued_samples=bound))
        try:
            o.submit(request("held", (1,)))
            wait_for(lambda o=o: o.stats().queued_requests == 0)
            for i in range(bound):
                o.submit(request(f"r{i}", (i + 2,)))
            with pytest.raises(Overloaded) as info:
                o.submit(request("over", (99,)))
            retries[bound] = info.value.retry_after_s
        finally:
            engine.gate.set()
            o.stop()
    # nothing has finished yet: a backlog of B samples over 2 slots waits B / 2 s (at least 1)
    assert retries == {2: 1.0, 20: 10.0}


@pytest.mark.parametrize("seed", [5, 2**31 + 5, 2**63 - 1, -(2**63)])
def test_a_seed_reaches_the_engine_unchanged(seed: int) -> None:
    engine = PickyEngine(max_slots=4)
    o = make(engine)
    try:
        tokens(o.submit(request("s", (7,), n=3, seed=seed, temperature=1.0)))
    finally:
        o.stop()
    assert engine.seeds[0] == seed
    assert len(set(engine.seeds)) == 3  # each sample its own seed
    assert all(-(2**63) <= s < 2**63 for s in engine.seeds if s is not None)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"temperature": 1e39},  # beyond float32: once written as inf with a RuntimeWarning
        {"presence_penalty": -1e300},
        {"min_tokens": 2**31},
        {"top_k": 2**31},
        {"top_k": -(2**40)},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
    ],
)
def test_sampling_params_refuse_values_the_device_cannot_hold(fields: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**fields)
