"""Speculative decoding: vLLM's config, n-gram proposals, the scheduler's verification on a
fake runner (tokens, backoff, the target distribution of seeded samples) and on the real
model (greedy and seeded output identical to the same requests without speculation)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.core.pages import PagePool
from engine.core.runner import StepPlan, StepResult
from engine.core.scheduler import Scheduler, SchedulerConfig, SequenceState
from engine.core.speculation import SpeculativeConfig, propose_ngram
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core
from tests.engine.core.test_scheduler import result_of

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'  # noqa: E501
GREEDY = SamplingParams(temperature=0.0, seed=0)


# -- the config ---------------------------------------------------------------------------
def test_config_reads_vllms_json_with_its_defaults() -> None:
    draft = SpeculativeConfig.parse(
        '{"method": "draft_model", "model": "small", "num_speculative_tokens": 3}'
    )
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "small", 3)
    full = SpeculativeConfig.parse(NGRAM)
    assert (full.method, full.num_speculative_tokens) == ("ngram", 4)
    assert (full.prompt_lookup_max, full.prompt_lookup_min) == (3, 1)
    bare = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (bare.prompt_lookup_max, bare.prompt_lookup_min) == (5, 5)
    low = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3}'
    )
    assert (low.prompt_lookup_max, low.prompt_lookup_min) == (3, 3)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[1]", "JSON object"),
        ("{", "JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "model": ""}', "folder"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model with"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}', "min"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
    ],
)
def test_a_bad_config_names_what_is_wrong(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(text)


# -- proposals ----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_tail() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 1, 3) == [7, 8]
    # the longest n-gram wins: [5, 6] occurs before 4 and [6] alone occurs last before 0
    assert propose_ngram([5, 6, 4, 6, 0, 5, 6], 1, 1, 2) == [4]
    assert propose_ngram([1, 2, 3], 3, 1, 2) == []  # nothing repeats
    assert propose_ngram([4, 4], 0, 1, 1) == []


def test_a_loop_shorter_than_the_draft_is_continued_through_itself() -> None:
    assert propose_ngram([9, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]


# -- the scheduler on a fake runner -------------------------------------------------------
VOCAB = 13


class FakeRunner:
    """A fake model: the next token is (last * 7 + 3) % 13 (it loops), or, with
    `distribution`, a draw from distribution[last] keyed by the row's seed and token index
    (the real sampler's contract: the key of the i-th token is a function of (seed, i))."""

    def __init__(self, distribution: np.ndarray | None = None) -> None:
        self.distribution = distribution
        self.steps = 0

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        tokens = []
        for r in plan.rows:
            inputs = [r.chunk.tokens[-1], *r.drafts]
            for j, last in enumerate(inputs):
                tokens.append(self._next(last, r.sampling.seed or 0, r.generated + j))
        return result_of(plan, tokens)

    def _next(self, last: int, seed: int, index: int) -> int:
        if self.distribution is None:
            return (last * 7 + 3) % VOCAB
        rng = np.random.default_rng([seed, index])
        return int(rng.choice(VOCAB, p=self.distribution[last]))


def run(
    spec: str | None,
    seqs: list[SequenceState],
    runner: FakeRunner,
    *,
    max_num_seqs: int = 8,
) -> tuple[dict[str, list[int]], Scheduler]:
    config = SpeculativeConfig.parse(spec) if spec else None
    pool = PagePool(200, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 64, 128, 8, 2, VOCAB, config), pool)
    out: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.busy:
        plan = scheduler.schedule()
        assert plan is not None
        assert plan.sample_rows <= max_num_seqs
        for event in scheduler.update(plan, runner.step(plan)):
            out[event.seq_id].append(event.token)
    assert pool.stats().free == pool.stats().total  # every page back, drafts' too
    return out, scheduler


def test_accepted_drafts_take_fewer_steps_for_the_same_tokens() -> None:
    def seqs() -> list[SequenceState]:
        return [SequenceState("a", (1, 2, 3), GREEDY, 40)]

    plain_runner, spec_runner = FakeRunner(), FakeRunner()
    plain, _ = run(None, seqs(), plain_runner)
    spec, scheduler = run(NGRAM, seqs(), spec_runner)
    assert spec == plain
    counters = scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.accepted_tokens > 0 and counters.accepted_per_position[3] > 0
    assert spec_runner.steps < plain_runner.steps / 2


def test_a_full_batch_proposes_nothing() -> None:
    seqs = [SequenceState(f"s{i}", (i + 1, i + 2), GREEDY, 20) for i in range(4)]
    out, scheduler = run(NGRAM, seqs, FakeRunner(), max_num_seqs=4)
    assert scheduler.speculator.counters.drafts == 0  # type: ignore[union-attr]
    assert all(len(tokens) == 20 for tokens in out.values())


def test_rejected_drafts_back_off_to_a_probe_every_few_steps() -> None:
    """A model that follows no n-gram: after a few rejections a sequence proposes one
    token about every fifth step (and keeps trying)."""
    distribution = np.full((VOCAB, VOCAB), 1.0 / VOCAB)
    runner = FakeRunner(distribution)
    seq = SequenceState("a", (1, 2, 1, 2, 1, 2, 1, 2), SamplingParams(temperature=1.0, seed=3), 120)
    _, scheduler = run(NGRAM, [seq], runner)
    counters = scheduler.speculator.counters  # type: ignore[union-attr]
    assert 10 < counters.drafts < runner.steps / 3
    assert counters.draft_tokens < 1.5 * counters.drafts  # mostly one-token drafts


def test_seeded_samples_follow_the_target_distribution() -> None:
    """Tokens after accepted and rejected drafts are draws from the target's distribution.

    A Markov target that leans towards a loop the n-grams learn, so drafts are sometimes
    accepted and mostly not (3,700 drafts, 14% of draft tokens accepted); over 400 seeds,
    the 24 transitions of each sample are tested against the target's rows with Pearson's
    chi-square at a false-failure rate of 1e-4 (seeds fixed: deterministic). Measured:
    113 on 113 degrees of freedom (threshold 178). A biased rule fails it: a planted
    `result.tokens[at] = drafts[0]` in Scheduler._verify (the first draft always taken)
    gives 1,152.
    """
    rng = np.random.default_rng(0)
    distribution = rng.dirichlet(np.full(VOCAB, 0.3), size=VOCAB)
    for last in range(VOCAB):  # lean towards the loop the n-grams learn
        distribution[last, (last * 7 + 3) % VOCAB] += 0.6
        distribution[last] /= distribution[last].sum()

    def samples() -> list[SequenceState]:
        return [
            SequenceState(
                f"s{i}", (1, 10, 8, 7, 1, 10), SamplingParams(temperature=1.0, seed=i), 24
            )
            for i in range(400)
        ]

    seqs = samples()
    spec: dict[str, list[int]] = {}
    drafts = draft_tokens = accepted = 0
    for group in range(0, len(seqs), 4):  # 4 at a time: rows to spare for drafts
        out, scheduler = run(NGRAM, seqs[group : group + 4], FakeRunner(distribution))
        spec |= out
        counters = scheduler.speculator.counters  # type: ignore[union-attr]
        drafts += counters.drafts
        draft_tokens += counters.draft_tokens
        accepted += counters.accepted_tokens
    assert drafts > 1000 and 0.1 < accepted / draft_tokens < 0.8, (drafts, accepted, draft_tokens)
    counts = np.zeros((VOCAB, VOCAB))
    for seq in seqs:
        tokens = [seq.prompt[-1], *spec[seq.seq_id]]
        for a, b in zip(tokens, tokens[1:], strict=False):
            counts[a, b] += 1
    statistic, dof = 0.0, 0
    for last in range(VOCAB):
        total = counts[last].sum()
        if total < 50:
            continue
        expected = total * distribution[last]
        keep = expected >= 5  # pool the rare cells (chi-square's usual rule)
        observed = np.append(counts[last][keep], counts[last][~keep].sum())
        expected = np.append(expected[keep], expected[~keep].sum())
        statistic += float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
        dof += len(observed) - 1
    assert dof > 20
    assert statistic < chi_square_quantile(dof, 1e-4), (statistic, dof)
    plain, _ = run(None, samples(), FakeRunner(distribution), max_num_seqs=16)
    assert plain == spec  # the same keys: the same draws


def chi_square_quantile(dof: int, alpha: float) -> float:
    """The upper alpha quantile of chi-square(dof), by Wilson and Hilferty's cube root."""
    z = {1e-4: 3.719, 1e-3: 3.090}[alpha]
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


# -- the real model -----------------------------------------------------------------------
def tokens_of(events: dict[str, list]) -> dict[str, list]:  # type: ignore[type-arg]
    """Each sequence's tokens, finish reasons and logprobs (a logprob only where the
    sequence asked: the others get whatever the step computed for its other rows)."""
    return {
        k: [(e.token, e.logprob if e.top else None, e.top, e.finish_reason) for e in v]
        for k, v in events.items()
    }


def test_greedy_and_seeded_output_is_the_same_with_speculation(tiny_checkpoint: Path) -> None:
    """Alone and eight at once, greedy, seeded with logprobs, with a stop token, a penalty
    (which does not speculate) and max_tokens: every event is the same as without
    speculation, bit for bit, and drafts were accepted."""
    seeded = SamplingParams(temperature=0.8, seed=7, logprobs=2)
    penalized = SamplingParams(temperature=0.0, seed=0, presence_penalty=0.5)

    def seqs() -> list[SequenceState]:
        out = [SequenceState(f"g{i}", tuple(range(3 + i, 40 + i)), GREEDY, 70) for i in range(4)]
        out += [
            SequenceState("seeded", tuple(range(9, 30)), seeded, 50),
            SequenceState("stop", tuple(range(3, 40)), GREEDY, 70, stop_token_ids=frozenset({57})),
            SequenceState("penalty", tuple(range(5, 30)), penalized, 30),
            SequenceState("short", tuple(range(3, 40)), GREEDY, 3),
        ]
        return out

    plain = core_of(tiny_checkpoint, max_num_seqs=16)
    spec = core_of(tiny_checkpoint, max_num_seqs=16, speculative_config=NGRAM)
    for a, b in zip(seqs(), seqs(), strict=True):  # alone
        assert tokens_of(run_core(spec, [a])) == tokens_of(run_core(plain, [b])), a.seq_id
    counters = spec.scheduler.speculator.counters
    alone_accepted = counters.accepted_tokens
    assert alone_accepted > 0
    assert tokens_of(run_core(spec, seqs())) == tokens_of(run_core(plain, seqs()))
    assert counters.accepted_tokens > alone_accepted
    assert spec.page_stats().free == spec.page_stats().total


def test_an_aborted_speculating_sequence_gives_its_pages_back(tiny_checkpoint: Path) -> None:
    core = core_of(tiny_checkpoint, max_num_seqs=8, speculative_config=NGRAM)
    core.add(SequenceState("a", tuple(range(3, 40)), GREEDY, 100))
    for _ in range(30):
        core.step()
    assert core.scheduler.speculator.counters.drafts > 0
    assert core.abort("a")
    assert not core.scheduler.busy
    assert core.page_stats().free == core.page_stats().total


# -- a draft model ------------------------------------------------------------------------
def draft_config(folder: Path, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(folder), "num_speculative_tokens": k})


def test_the_target_as_its_own_draft_is_always_right(tiny_checkpoint: Path) -> None:
    """Greedy drafts from the target itself: every draft token is accepted, the first
    time and again through the prefix cache (the draft's K/V in cached pages is right),
    and the output is the output without speculation."""

    def seqs() -> list[SequenceState]:
        return [SequenceState(f"g{i}", tuple(range(3 + i, 40 + i)), GREEDY, 40) for i in range(3)]

    plain = core_of(tiny_checkpoint, max_num_seqs=16)
    spec = core_of(
        tiny_checkpoint, max_num_seqs=16, speculative_config=draft_config(tiny_checkpoint)
    )
    want = tokens_of(run_core(plain, seqs()))
    for _ in range(2):  # the second time, the prompts come from the prefix cache
        assert tokens_of(run_core(spec, seqs())) == want
    counters = spec.scheduler.speculator.counters
    assert spec.scheduler.prefix_hits > 0
    assert counters.draft_tokens > 100 and counters.accepted_tokens == counters.draft_tokens
    assert spec.page_stats().free == spec.page_stats().total


def test_another_draft_model_changes_no_token(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    """A one-layer draft with other weights: greedy, seeded, batched, and preempted for
    pages (a pool of 40 pages for 8 sequences): the same events as without speculation."""
    target = tiny_checkpoint_of()
    draft = tiny_checkpoint_of(seed=1, num_hidden_layers=1)
    seeded = SamplingParams(temperature=0.8, seed=7, logprobs=2)

    def seqs() -> list[SequenceState]:
        return [
            SequenceState(f"s{i}", tuple(range(3 + i, 40 + i)), GREEDY if i % 2 else seeded, 40)
            for i in range(8)
        ]

    plain = core_of(target, max_num_seqs=16, num_pages=40)
    spec = core_of(target, max_num_seqs=16, num_pages=40, speculative_config=draft_config(draft))
    assert tokens_of(run_core(spec, seqs())) == tokens_of(run_core(plain, seqs()))
    assert spec.scheduler.speculator.counters.drafts > 0
    assert spec.scheduler.preemptions > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    from engine.tiny import build_llama_checkpoint

    target = tiny_checkpoint_of()
    other = build_llama_checkpoint(target.parent / "other-vocab", 32, 1, 2, 1, 64, 300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        core_of(target, speculative_config=draft_config(other))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_a_quantized_model_changes_no_token(
    tiny_checkpoint: Path, method: str
) -> None:
    """int8 weights and an int8 KV cache, with either method: the events without it."""
    config = NGRAM if method == "ngram" else draft_config(tiny_checkpoint)
    quant = {"quantization": "int8", "kv_cache_dtype": "int8", "max_num_seqs": 16}

    def seqs() -> list[SequenceState]:
        seeded = SamplingParams(temperature=0.8, seed=7, logprobs=2)
        return [
            SequenceState(f"s{i}", tuple(range(3 + i, 40 + i)), GREEDY if i % 2 else seeded, 40)
            for i in range(4)
        ]

    plain = core_of(tiny_checkpoint, **quant)
    spec = core_of(tiny_checkpoint, speculative_config=config, **quant)
    assert tokens_of(run_core(spec, seqs())) == tokens_of(run_core(plain, seqs()))
    assert spec.scheduler.speculator.counters.accepted_tokens > 0
