"""Structured outputs through the orchestrator on the fake engine: the generate stage feeds
every constrained token, in order, to the sample's matcher (on the grammar worker), ends a
sample with "stop" the moment its grammar is complete (whatever ignore_eos and min_tokens
say), and fails only the request whose grammar refuses a token."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engine.fake import FakeEngine, FakeTokenizer, fake_token
from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest, Delta, RequestRejected
from engine.sampling import mask_words
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams

VOCAB = 1000


class Matcher:
    def __init__(self, owner: Constraint) -> None:
        self.owner = owner
        self.seen: list[int] = []
        owner.matchers.append(self)

    def advance(self, token_id: int) -> bool:
        self.seen.append(token_id)
        if self.owner.fail_at == len(self.seen):
            raise ValueError(f"token {token_id} refused")
        return self.owner.complete_after == len(self.seen)

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = -1


class Constraint:
    """Complete after `complete_after` tokens, or refuse the `fail_at`-th."""

    def __init__(self, complete_after: int | None = None, fail_at: int | None = None) -> None:
        self.complete_after, self.fail_at = complete_after, fail_at
        self.matchers: list[Matcher] = []

    def initial_mask(self) -> np.ndarray:
        return np.full((mask_words(VOCAB),), -1, np.int32)

    def matcher(self) -> Matcher:
        return Matcher(self)


@pytest.fixture
def orch() -> Iterator[Orchestrator]:
    tokenizer = FakeTokenizer()
    o = Orchestrator(
        FakeEngine(max_slots=4, vocab_size=VOCAB),
        text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids),
    )
    o.start()
    yield o
    o.stop()


def request(rid: str, constraint: Constraint | None, seed: int = 1, **kw: object) -> ActiveRequest:
    sampling = SamplingParams(temperature=0.0, seed=seed, constraint=constraint)
    return ActiveRequest(request_id=rid, prompt_ids=(5, 6, 7), sampling=sampling, **kw)  # type: ignore[arg-type]


def tokens(deltas: list[Delta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


@pytest.mark.parametrize("complete_after", [1, 2, 5])
def test_a_complete_grammar_ends_the_sample_with_stop(orch: Orchestrator, complete_after: int):
    constraint = Constraint(complete_after=complete_after)
    req = request("r", constraint, max_tokens=20, ignore_eos=True)
    deltas = orch.submit(req).collect(timeout=30)
    want = [fake_token((5, 6, 7), 1, i) for i in range(complete_after)]
    assert tokens(deltas) == want
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)
    assert constraint.matchers[0].seen == want  # every token, in order, once


def test_the_grammar_ends_a_sample_before_min_tokens(orch: Orchestrator):
    constraint = Constraint(complete_after=3)
    req = ActiveRequest(
        request_id="m",
        prompt_ids=(5, 6, 7),
        sampling=SamplingParams(temperature=0.0, seed=1, min_tokens=10, constraint=constraint),
        max_tokens=20,
    )
    deltas = orch.submit(req).collect(timeout=30)
    assert len(tokens(deltas)) == 3 and deltas[-1].finish_reason == "stop"


def test_each_sample_has_its_own_matcher(orch: Orchestrator):
    constraint = Constraint(complete_after=4)
    deltas = orch.submit(request("n", constraint, max_tokens=10, n=3)).collect(timeout=30)
    seen = sorted(m.seen for m in constraint.matchers)
    assert seen == sorted(tokens(deltas, k) for k in range(3))
    assert all(len(s) == 4 for s in seen)


def test_the_budget_still_ends_an_unfinished_grammar(orch: Orchestrator):
    deltas = orch.submit(request("b", Constraint(), max_tokens=6)).collect(timeout=30)
    assert len(tokens(deltas)) == 6 and deltas[-1].finish_reason == "length"


def test_a_refused_token_fails_that_request_only(orch: Orchestrator):
    neighbour = orch.submit(request("ok", None, seed=2, max_tokens=30))
    failing = orch.submit(request("bad", Constraint(fail_at=3), max_tokens=30))
    with pytest.raises(RequestRejected, match="token .* refused"):
        failing.collect(timeout=30)
    deltas = neighbour.collect(timeout=30)
    assert tokens(deltas) == [fake_token((5, 6, 7), 2, i) for i in range(30)]
    assert orch.alive
    after = orch.submit(request("after", Constraint(complete_after=2), max_tokens=9))
    assert len(tokens(after.collect(timeout=30))) == 2


def test_unconstrained_batches_start_no_grammar_worker(orch: Orchestrator):
    for i in range(3):
        orch.submit(request(f"u{i}", None, seed=i, max_tokens=8)).collect(timeout=30)
    assert orch._generate.grammar is None
