"""A new sample's first token goes ahead of the generate steps queued before it.

Unit tests of the detokenize queue (engine.stages.queues.FirstTokensAhead), and the
orchestrator on the fake engine with a slow text path, where the detokenize queue
is always full: a request inserted then must get its first token before the steps
already queued are read, and every token of every request must still come in order.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from engine.fake import FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator, OrchestratorConfig
from engine.request import ActiveRequest, Delta
from engine.stages.detokenize import TextStream, text_streams
from engine.stages.queues import FirstTokensAhead
from engine.types import SamplingParams

SLOW_ADD_S = 0.2  # the running request's text path per token: far longer than a fake step


def lane(size: int = 2) -> FirstTokensAhead[str]:
    return FirstTokensAhead(size, lambda item: item.startswith("first"))


def test_first_tokens_are_taken_before_queued_steps_in_their_own_order() -> None:
    q = lane()
    q.put("step0")
    q.put("step1")
    q.put("first-a")
    q.put("first-b")
    assert q.qsize() == 4
    assert [q.get() for _ in range(4)] == ["first-a", "first-b", "step0", "step1"]


def test_steps_are_bounded_and_first_tokens_never_wait() -> None:
    q = lane(size=2)
    q.put("step0")
    q.put("step1")
    with pytest.raises(queue.Full):
        q.put("step2", timeout=0.01)
    for i in range(10):  # bounded by the slots elsewhere, never here
        q.put(f"first{i}", timeout=0.01)
    assert q.get() == "first0"
    with pytest.raises(queue.Empty):
        lane().get(timeout=0.01)
    with pytest.raises(ValueError, match="size"):
        lane(size=0)


def test_a_blocked_step_put_resumes_when_a_step_is_taken() -> None:
    q = lane(size=1)
    q.put("step0")
    done = threading.Event()

    def producer() -> None:
        q.put("step1")
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not done.wait(0.05)
    assert q.get() == "step0"
    assert done.wait(5)
    thread.join()
    assert q.get() == "step1"


class _Slow:
    """A text stream that takes SLOW_ADD_S per token (a detokenizer far behind the steps)."""

    def __init__(self, inner: TextStream):
        self._inner = inner

    @property
    def tokens(self) -> int:
        return self._inner.tokens

    def add(self, token_id: int, *, last: bool = False, done: bool = False) -> object:
        time.sleep(SLOW_ADD_S)
        return self._inner.add(token_id, last=last, done=done)


def request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> ActiveRequest:
    sampling = SamplingParams(temperature=0.0, seed=0)
    return ActiveRequest(
        request_id=rid, prompt_ids=prompt, sampling=sampling, max_tokens=max_tokens
    )


def test_a_new_request_gets_its_first_token_before_the_steps_queued_ahead_of_it() -> None:
    tokenizer = FakeTokenizer()
    plain = text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids)

    def streams(req: ActiveRequest, sampling: SamplingParams) -> TextStream:
        stream = plain(req, sampling)
        return _Slow(stream) if req.request_id == "slow" else stream  # type: ignore[return-value]

    orch = Orchestrator(
        FakeEngine(max_slots=4), streams, OrchestratorConfig(detokenize_queue_size=2)
    )
    orch.start()
    try:
        slow = orch.submit(request("slow", (1, 2, 3), max_tokens=16))
        slow_deltas: list[Delta] = []
        for delta in slow:  # wait until the queue is full behind the slow text path
            slow_deltas.append(delta)
            if len(slow_deltas) == 4:
                break
        new = orch.submit(request("new", (4, 5), max_tokens=3))
        new_deltas = new.collect(timeout=10)
        slow_deltas += slow.collect(timeout=30)
    finally:
        orch.stop()

    assert [t for d in new_deltas for t in d.token_ids] == [
        fake_token((4, 5), 0, i) for i in range(3)
    ]
    assert [t for d in slow_deltas for t in d.token_ids] == [
        fake_token((1, 2, 3), 0, i) for i in range(16)
    ]
    inserted = new.timings.inserted
    first = new_deltas[0].emitted
    assert inserted is not None
    # Between the new request's insert and its first token, the slow one gets at most the
    # token being detokenized then (behind the queued steps it would get 2 more).
    between = [d for d in slow_deltas if inserted < d.emitted < first]
    assert len(between) <= 1, [round(d.emitted - inserted, 3) for d in between]
