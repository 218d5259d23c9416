"""Token budgets are counted by the generate stage alone; the text path ends samples on its word."""

from __future__ import annotations

from engine.fake import FakeEngine, FakeTokenizer
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest, RequestStream
from engine.stages.detokenize import TextStream, text_streams
from engine.types import SamplingParams
from tests.engine.test_orchestrator_faults import idle, wait_for


class MiscountingStream:
    """A text stream whose own token count lags one behind (as a count kept twice can)."""

    def __init__(self, inner: TextStream):
        self._inner = inner

    @property
    def tokens(self) -> int:
        return self._inner.tokens - 1

    def add(self, token_id: int, *, last: bool = False, done: bool = False):  # type: ignore[no-untyped-def]
        return self._inner.add(token_id, last=last, done=done)


def finish(stream: RequestStream) -> tuple[int, str | None]:
    deltas = stream.collect(timeout=10)
    return sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason


def test_a_sample_ends_at_its_budget_whatever_the_text_path_counts() -> None:
    tokenizer = FakeTokenizer()
    real = text_streams(tokenizer.detokenizer, ())
    o = Orchestrator(
        FakeEngine(max_slots=2),
        lambda request, sampling: MiscountingStream(real(request, sampling)),  # type: ignore[arg-type,return-value]
    )
    o.start()
    try:
        for rid, max_tokens in (("a", 1), ("b", 5), ("c", 3)):
            req = ActiveRequest(rid, (1, 2, 3), SamplingParams(temperature=0.0), max_tokens)
            assert finish(o.submit(req)) == (max_tokens, "length")
        wait_for(lambda: idle(o))
        assert idle(o)
    finally:
        o.stop()
