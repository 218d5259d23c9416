"""The scheduler alone, on a fake runner whose next token is a function of the sequence's
own last token and position: under random arrivals, prompt lengths, budgets, page pools
and aborts, every step keeps its bounds, no page is lost or shared by mistake, the
scheduler never stalls while sequences wait, and every sequence that is not aborted
ends with the tokens it gets alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.pages import PagePool
from engine.core.runner import StepPlan, StepResult
from engine.core.scheduler import Scheduler, SchedulerConfig, SequenceState
from engine.core.speculation import SpeculativeConfig
from engine.types import MAX_LOGPROBS, SamplingParams

VOCAB = 97
PAGE = 4


def next_token(token: int, position: int, looping: bool = False) -> int:
    """The fake model: (last token * 31 + position) % VOCAB, or, looping, a function of the
    last token alone (it falls into short cycles, where n-gram drafts are right)."""
    return (token * 7 + 3) % 13 if looping else (token * 31 + position) % VOCAB


class FakeRunner:
    """Samples `next_token` for each sampled row (a speculating row's drafts each one too)."""

    def __init__(self, looping: bool = False) -> None:
        self.looping = looping

    def step(self, plan: StepPlan) -> StepResult:
        tokens = [
            next_token(c.tokens[-1], c.start + len(c.tokens), self.looping) for c in plan.chunks()
        ]
        return result_of(plan, tokens)


def result_of(plan: StepPlan, tokens: list[int]) -> StepResult:
    """A fake runner's StepResult: these tokens, one per sampled row, no logprobs."""
    n = len(tokens)
    starts, sample_rows = plan.offsets()
    return StepResult(
        tokens=np.asarray(tokens, np.int32),
        logprobs=np.zeros(n, np.float32),
        top_ids=np.zeros((n, MAX_LOGPROBS), np.int32),
        top_logprobs=np.zeros((n, MAX_LOGPROBS), np.float32),
        starts=starts,
        sample_rows=sample_rows,
    )


def alone(prompt: list[int], max_tokens: int, looping: bool = False) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens[-1], len(tokens), looping))
    return tokens[len(prompt) :]


GREEDY = SamplingParams(temperature=0.0, seed=0)
requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),  # prompt
        st.integers(1, 12),  # max_tokens
        st.integers(0, 6),  # arrives at this step
        st.booleans(),  # aborted a few steps after it arrives
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None, derandomize=True)  # the same cases in every run
@given(
    reqs=requests,
    seqs=st.integers(1, 5),
    budget=st.sampled_from([8, 12, 16, 32]),
    spare=st.integers(0, 20),
    prefill_seqs=st.integers(1, 3),
    shared=st.booleans(),
    looping=st.booleans(),
    drafts=st.sampled_from([0, 1, 3]),
    beside_decode=st.sampled_from([0, 4]),
)
def test_random_workloads_end_with_their_own_tokens(
    reqs, seqs, budget, spare, prefill_seqs, shared, looping, drafts, beside_decode
) -> None:  # type: ignore[no-untyped-def]
    """...with n-gram speculation too (drafts > 0): its steps keep the same bounds, a
    draft's positions have pages, and every sequence still gets its own tokens; and with
    smaller chunks beside decode rows (beside_decode > 0), which no step exceeds."""
    max_len = 56
    pool = PagePool(max_len // PAGE + spare, PAGE)
    spec = None
    if drafts:
        spec = SpeculativeConfig("ngram", drafts, prompt_lookup_max=3, prompt_lookup_min=1)
    config = SchedulerConfig(
        seqs, budget, max_len, 8, prefill_seqs, VOCAB, spec,
        decode_chunk_size=beside_decode, any_form_hits=beside_decode > 0,
    )  # fmt: skip
    scheduler, runner = Scheduler(config, pool), FakeRunner(looping)
    if shared:  # every prompt starts the same way: prefix-cache hits
        reqs = [([5, 6, 7, 8, 9, 10, 11, 12, *p], n, t, a) for p, n, t, a in reqs]
    reqs = [(p[: max_len - 1 - 12], n, t, a) for p, n, t, a in reqs]
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while step < 2000:
        for i, (prompt, n, at, abort) in enumerate(reqs):
            name = f"r{i}"
            if at == step:
                scheduler.add(SequenceState(name, tuple(prompt), GREEDY, n))
                got[name] = []
            if abort and at + 2 == step and name not in aborted:
                aborted.add(name)
                scheduler.abort(name)
        if step > max(at for _, _, at, _ in reqs) + 3 and not scheduler.busy:
            break
        plan = scheduler.schedule()
        step += 1
        if plan is None:
            continue
        assert plan.tokens <= budget
        assert plan.sample_rows <= seqs
        assert sum(1 for r in plan.rows if len(r.chunk.tokens) > 1 or not r.emits) <= (prefill_seqs)
        prompts = {s.row: len(s.prompt) for s in scheduler.running}
        if beside_decode and any(r.chunk.start >= prompts[r.row] for r in plan.rows):
            assert max(len(r.chunk.tokens) for r in plan.rows) <= beside_decode  # decode rows
        holders = {p for r in plan.rows for p in r.chunk.pages}
        for r in plan.rows:
            end = r.chunk.start + len(r.chunk.tokens) + len(r.drafts)
            assert len(r.chunk.pages) * PAGE >= end
            assert all(pool.refcount(p) > 0 for p in r.chunk.pages)
        assert len(holders) <= pool.num_pages
        for event in scheduler.update(plan, runner.step(plan)):
            assert event.seq_id not in aborted
            got[event.seq_id].append(event.token)
    assert not scheduler.busy, "the scheduler did not finish"
    stats = pool.stats()
    assert stats.free == stats.total  # every page is back (some cached)
    for i, (prompt, n, _, _) in enumerate(reqs):
        if f"r{i}" not in aborted:
            assert got[f"r{i}"] == alone(prompt, n, looping), i
    if scheduler.speculator is not None:
        counters = scheduler.speculator.counters
        assert counters.accepted_tokens == sum(counters.accepted_per_position)
        assert counters.accepted_tokens <= counters.draft_tokens


def test_two_long_prompts_that_cannot_both_fit_do_not_deadlock() -> None:
    """14 pages of 4; two 40-token prompts in chunks of 8, side by side: each grows until
    neither can take its next chunk; the older preempts the younger and both end."""
    pool = PagePool(14, PAGE, prefix_caching=False)
    scheduler, runner = Scheduler(SchedulerConfig(2, 16, 56, 8, 2, VOCAB), pool), FakeRunner()
    prompts = [list(range(1, 41)), list(range(41, 81))]
    for i, prompt in enumerate(prompts):
        scheduler.add(SequenceState(f"r{i}", tuple(prompt), GREEDY, 6))
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(200):
        plan = scheduler.schedule()
        if plan is None:
            break
        for event in scheduler.update(plan, runner.step(plan)):
            got[event.seq_id].append(event.token)
    assert scheduler.preemptions > 0
    assert got == {f"r{i}": alone(p, 6) for i, p in enumerate(prompts)}
