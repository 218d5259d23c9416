"""Prefill first on shared devices: a decode step waits for the prefill calls dispatched
before it, and the prefill stage waits for its call before taking the next prompts.

The fake engine's first tokens here are "device values" that say when they were waited
for (block_until_ready), so the order of dispatches and waits is checked exactly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.fake import FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest
from engine.stages.detokenize import text_streams
from engine.stages.queues import StepClock
from engine.types import Prefix, SamplingParams


class Pending:
    """A device value: the first token of one prefill call, ready once waited for."""

    def __init__(self, value: int, call: int, log: list[tuple[str, int]], lock: threading.Lock):
        self.value, self.call, self._log, self._lock = value, call, log, lock

    def block_until_ready(self) -> Pending:
        with self._lock:
            if ("ready", self.call) not in self._log:
                self._log.append(("ready", self.call))
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.value, dtype)

    def __int__(self) -> int:
        return self.value


class LoggingEngine(FakeEngine):
    """Logs ("prefill", call) at each prefill dispatch and ("step", n) at each step."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.calls = 0
        self.steps_taken = 0

    def _pending(self, prefixes: list[Prefix]) -> list[Prefix]:
        with self.lock:
            call = self.calls
            self.calls += 1
            self.log.append(("prefill", call))
        return [
            dataclasses.replace(p, token=Pending(int(p.token), call, self.log, self.lock))
            for p in prefixes
        ]

    def prefill(self, token_ids: Sequence[int], sampling: SamplingParams, **kw: Any) -> Prefix:
        return self._pending([super().prefill(token_ids, sampling, **kw)])[0]

    def prefill_batch(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[Prefix]:
        return self._pending(super().prefill_batch(prompts))

    def generate(self, state: Any, batch: int | None = None) -> Any:
        with self.lock:
            self.log.append(("step", self.steps_taken))
            self.steps_taken += 1
        return super().generate(state, batch)


def test_a_step_waits_only_for_the_prefills_dispatched_before_it() -> None:
    log: list[str] = []

    class Output:
        def __init__(self, name: str):
            self.name = name

        def block_until_ready(self) -> Output:
            log.append(self.name)
            return self

    clock = StepClock()
    clock.wait_prefills()  # nothing dispatched: returns at once
    clock.prefilled([Output("a")])
    clock.prefilled([Output("b")])
    clock.wait_prefills()
    clock.wait_prefills()  # already waited for
    assert log == ["a", "b"]
    own_devices = StepClock(prefill_first=False)
    own_devices.prefilled([Output("c")])
    own_devices.wait_prefills()
    assert log == ["a", "b"]


def test_no_step_is_dispatched_before_an_earlier_prefill_is_done_and_tokens_stay_exact() -> None:
    engine = LoggingEngine(max_slots=8)
    tokenizer = FakeTokenizer()
    orch = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    orch.start()
    try:
        prompts = [tuple(range(1 + i, 6 + i)) for i in range(24)]
        streams = []
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(temperature=0.0, seed=i)
            request = ActiveRequest(
                request_id=f"r{i}", prompt_ids=prompt, sampling=sampling, max_tokens=6
            )
            streams.append(orch.submit(request))
        results = [[t for d in s.collect(timeout=30) for t in d.token_ids] for s in streams]
    finally:
        orch.stop()
    assert results == [[fake_token(p, i, k) for k in range(6)] for i, p in enumerate(prompts)]
    log = list(engine.log)
    assert engine.calls >= 1 and engine.steps_taken >= 6
    for position, (kind, number) in enumerate(log):
        if kind == "step":  # every prefill dispatched before this step was waited for first
            for call in (n for k, n in log[:position] if k == "prefill"):
                assert log.index(("ready", call)) < position, (call, number, log[: position + 1])
        if kind == "prefill" and number > 0:  # and before the next prefill call
            assert log.index(("ready", number - 1)) < position, log[: position + 1]
