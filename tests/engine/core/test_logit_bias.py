"""logit_bias and allowed_token_ids on the engine core: every sampled token obeys them,
the first included, for a short prompt and one in several chunks, and sequences without
them keep their tokens and logprobs, bit for bit, beside sequences with them."""

from __future__ import annotations

import numpy as np

from engine.core.scheduler import SequenceState
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core

PROMPT = (0, 42, 364, 78, 81, 277, 67)
LONG = tuple((31 * i + 7) % 500 for i in range(80))  # five chunks of 16
STEPS = 9


def tokens(folder, sampling: SamplingParams, prompt=PROMPT) -> list[int]:  # type: ignore[no-untyped-def]
    events = run_core(core_of(folder), [SequenceState("s", prompt, sampling, STEPS)])["s"]
    return [e.token for e in events]


def test_a_bias_of_plus_or_minus_100_decides_every_token(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama")
    for prompt in (PROMPT, LONG):
        plain = tokens(folder, SamplingParams(temperature=0.0, seed=1), prompt)
        target = next(t for t in range(5, 500) if t not in plain)
        up = SamplingParams(temperature=0.0, seed=1, logit_bias=((target, 100.0),))
        assert tokens(folder, up, prompt) == [target] * STEPS
        down = SamplingParams(temperature=0.0, seed=1, logit_bias=((plain[0], -100.0),))
        assert plain[0] not in tokens(folder, down, prompt)


def test_allowed_token_ids_restrict_every_sampled_token(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama")
    allowed = (3, 17, 101, 250)
    seen: set[int] = set()
    for prompt in (PROMPT, LONG):
        for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
            sampling = SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=allowed)
            got = tokens(folder, sampling, prompt)
            assert set(got) <= set(allowed)
            seen |= set(got)
    assert len(seen) > 1


def test_sequences_without_bias_or_mask_keep_their_bits_beside_those_with_them(
    tiny_checkpoint_of,
) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama")
    plain = (
        SamplingParams(temperature=0.0, seed=1, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2, logprobs=2),
    )
    prompts = (PROMPT, (0, 5, 9, 200), (0, 77, 88), tuple(range(40, 60)))

    def batch(third: SamplingParams, fourth: SamplingParams) -> dict[str, list]:  # type: ignore[type-arg]
        seqs = [
            SequenceState(f"s{i}", p, s, STEPS)
            for i, (p, s) in enumerate(zip(prompts, (*plain, third, fourth), strict=True))
        ]
        return run_core(core_of(folder), seqs)

    greedy = SamplingParams(temperature=0.0, seed=5)
    alone = batch(greedy, greedy)
    mixed = batch(
        SamplingParams(temperature=0.0, seed=5, logit_bias=((33, 100.0),)),
        SamplingParams(temperature=1.0, seed=6, allowed_token_ids=(4, 8)),
    )
    for name in ("s0", "s1"):
        assert [e.token for e in mixed[name]] == [e.token for e in alone[name]]
        got = np.array([e.logprob for e in mixed[name]], np.float32).view(np.uint32)
        want = np.array([e.logprob for e in alone[name]], np.float32).view(np.uint32)
        np.testing.assert_array_equal(got, want)
    assert [e.token for e in mixed["s2"]] == [33] * STEPS
    assert {e.token for e in mixed["s3"]} <= {4, 8}
