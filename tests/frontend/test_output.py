"""The output processor's admission count and open requests, driven without a core process:
its inputs are the core's Outputs messages, its outputs the Deltas and the messages sent.
The count is read the way production reads it: by what the admission bound lets in."""

from __future__ import annotations

import random
import threading

import pytest

from engine.core.messages import Abort, AddRequest, Outputs, Stats, ToCore, TokenOut
from engine.types import SamplingParams
from frontend.input import add_request, sample_samplings
from frontend.output import OutputProcessor
from frontend.request import ActiveRequest, Overloaded, RequestStream
from frontend.text import TextStream
from tokenization.stream import TextStream as Stream

STATS = Stats(0, 0, 1, 1, 0, 0, 0, 0, 0)


class Digits:
    """A detokenizer whose text of token t is str(t)."""

    def add(self, token_id: int) -> str:
        return str(token_id)

    def flush(self) -> str:
        return ""


def streams(request: ActiveRequest, sampling: SamplingParams) -> TextStream:
    return Stream(Digits())


def processor(sent: list[ToCore], max_queued: int = 1000) -> OutputProcessor:
    out = OutputProcessor(streams, sent.append, max_queued)
    out.refuse(None)
    return out


def submit(out: OutputProcessor, request_id: str, n: int) -> RequestStream:
    request = ActiveRequest(request_id, (1, 2), SamplingParams(seed=1), max_tokens=4, n=n)
    samplings = sample_samplings(request)
    return out.open(request, samplings, add_request(request, samplings))


def token(request_id: str, index: int, value: int = 7, finish: str | None = None) -> TokenOut:
    return TokenOut(request_id, index, value, 0.0, finish=finish)


def waiting(out: OutputProcessor, bound: int) -> int:
    """The admission count, as the bound sees it: the most samples one more request may
    ask for is bound - count (probed, then aborted again; a count gone negative, a sample
    subtracted twice, would let more than `bound` in)."""
    for room in range(bound + 8, 0, -1):
        try:
            submit(out, "probe", n=room)
        except Overloaded:
            continue
        out.abort("probe")
        return bound - room
    return bound


def open_count(out: OutputProcessor) -> int:
    """Requests still open (what a drain waits for)."""
    return out.wait_idle(0, threading.Event())


def test_an_abort_between_two_first_tokens_counts_each_sample_once() -> None:
    sent: list[ToCore] = []
    out = processor(sent, max_queued=4)
    stream = submit(out, "r", n=2)
    assert isinstance(sent[0], AddRequest)
    assert waiting(out, 4) == 2
    out.take(Outputs((token("r", 0),), STATS))
    assert waiting(out, 4) == 1
    out.abort("r")
    assert Abort((("r", 0), ("r", 1))) in sent
    assert waiting(out, 4) == 0
    out.take(Outputs((token("r", 1),), STATS))  # in flight when the abort went out
    assert waiting(out, 4) == 0  # not -1: the sample left the count once
    assert stream.finished and open_count(out) == 0
    assert [d.index for d in stream] == [0]  # the token after the abort was dropped


def test_aborts_racing_the_receiver_leave_the_count_at_zero() -> None:
    """Many requests, first tokens from one thread and aborts from another, in random
    order: every sample leaves the count exactly once, whichever comes first."""
    sent: list[ToCore] = []
    out = processor(sent, max_queued=600)
    ids = [f"r{i}" for i in range(300)]
    for request_id in ids:
        submit(out, request_id, n=2)
    assert waiting(out, 600) == 600
    rng = random.Random(0)
    firsts = [(request_id, i) for request_id in ids for i in range(2)]
    rng.shuffle(firsts)
    aborts = rng.sample(ids, len(ids) // 2)
    start = threading.Barrier(2)

    def receive() -> None:
        start.wait()
        for request_id, index in firsts:
            out.take(Outputs((token(request_id, index),), STATS))

    def abort() -> None:
        start.wait()
        for request_id in aborts:
            out.abort(request_id)

    threads = [threading.Thread(target=receive), threading.Thread(target=abort)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert waiting(out, 600) == 0  # every sample has a first token or was aborted
    assert open_count(out) == len(ids) - len(aborts)
    for request_id in ids:
        out.abort(request_id)
    assert waiting(out, 600) == 0 and open_count(out) == 0


def test_a_sample_the_core_ends_is_counted_and_closed_once() -> None:
    sent: list[ToCore] = []
    out = processor(sent)
    stream = submit(out, "r", n=1)
    out.take(Outputs((token("r", 0, 4), token("r", 0, 5, finish="length")), STATS))
    assert stream.finished
    deltas = list(stream)
    assert [d.text for d in deltas] == ["4", "5"]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 2
    assert not any(isinstance(m, Abort) for m in sent)  # the core ended it itself
    assert waiting(out, 1000) == 0 and open_count(out) == 0


def test_the_admission_bound_counts_samples_without_a_first_token() -> None:
    sent: list[ToCore] = []
    out = processor(sent, max_queued=3)
    submit(out, "a", n=2)
    with pytest.raises(Overloaded):
        submit(out, "b", n=2)
    out.take(Outputs((token("a", 0),), STATS))
    submit(out, "b", n=2)  # a's first sample started: room for two
    assert waiting(out, 3) == 3
