"""logit_bias and allowed_token_ids on the real engine: the first token (prefill) and every
decode step obey them, and slots without them keep their bits beside slots with them."""

from __future__ import annotations

import numpy as np
import pytest

from engine.types import SamplingParams
from tests.engine.conftest import batch_lengths

PROMPT = [0, 42, 364, 78, 81, 277, 67]
STEPS = 8


def run(engine, sampling: SamplingParams, prompt=PROMPT, steps: int = STEPS) -> list[int]:
    """The prompt's first token and `steps` decode steps, alone in slot 0 of bucket 1."""
    prefix = engine.prefill(prompt, sampling)
    state = engine.insert(prefix, engine.init_state(), 0)
    tokens = [int(prefix.token)]
    for _ in range(steps):
        state, out = engine.generate(state, engine.decode_bucket(1))
        tokens.append(int(out.tokens[0]))
    return tokens


def test_a_plus_100_bias_makes_greedy_pick_that_token_at_every_step(small_engine):
    plain = run(small_engine, SamplingParams(temperature=0.0, seed=1))
    target = next(t for t in range(5, small_engine.vocab_size) if t not in plain)
    biased = run(
        small_engine, SamplingParams(temperature=0.0, seed=1, logit_bias=((target, 100.0),))
    )
    assert biased == [target] * (STEPS + 1)


def test_a_minus_100_bias_on_the_greedy_token_changes_it(small_engine):
    plain = run(small_engine, SamplingParams(temperature=0.0, seed=1))
    banned = plain[0]
    biased = run(
        small_engine, SamplingParams(temperature=0.0, seed=1, logit_bias=((banned, -100.0),))
    )
    assert biased[0] != banned
    assert banned not in biased


def test_allowed_token_ids_restrict_every_sampled_token(small_engine):
    allowed = (3, 17, 101, 250)
    for temperature in (0.0, 1.0):
        for seed in range(6):
            sampling = SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=allowed)
            assert set(run(small_engine, sampling)) <= set(allowed)
    # n > 1: resampled first tokens obey the same mask
    prefix = small_engine.prefill(PROMPT, SamplingParams(seed=0, allowed_token_ids=allowed))
    firsts = {
        int(small_engine.resample(prefix, SamplingParams(seed=s, allowed_token_ids=allowed)).token)
        for s in range(40)
    }
    assert firsts <= set(allowed) and len(firsts) > 1


def test_allowed_token_ids_and_bias_in_a_batched_prefill(small_engine):
    allowed = (9, 10)
    long, short = batch_lengths(small_engine) or pytest.fail("no batched prefill shape")
    prompts = [
        ((PROMPT * 10)[:long], SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed)),
        ((PROMPT * 10)[:short], SamplingParams(temperature=0.0, seed=4, logit_bias=((77, 100.0),))),
    ]
    assert small_engine.batch_fits([len(p) for p, _ in prompts])
    first, second = small_engine.prefill_batch(prompts)
    assert int(first.token) in allowed
    assert int(second.token) == 77


def test_slots_without_bias_or_mask_give_the_tokens_they_give_alone(small_engine):
    """Same bucket (every slot), same slots; only slots 2 and 3 change between the runs."""
    engine = small_engine
    plain = (
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2, logprobs=2),
    )
    prompts = (PROMPT, [0, 5, 9, 200], [0, 77, 88], list(range(40, 60)))

    def batch(third: SamplingParams, fourth: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
        state = engine.init_state()
        firsts = []
        for slot, (prompt, sampling) in enumerate(
            zip(prompts, (*plain, third, fourth), strict=True)
        ):
            prefix = engine.prefill(prompt, sampling)
            firsts.append(int(prefix.token))
            state = engine.insert(prefix, state, slot)
        tokens, logprobs = [firsts], []
        for _ in range(STEPS):
            state, out = engine.generate(state)
            tokens.append(np.asarray(out.tokens).tolist())
            logprobs.append(np.asarray(out.logprobs))
        return np.array(tokens), np.array(logprobs)

    greedy = SamplingParams(temperature=0.0, seed=5)
    alone_tokens, alone_lp = batch(greedy, greedy)
    mixed_tokens, mixed_lp = batch(
        SamplingParams(temperature=0.0, seed=5, logit_bias=((33, 100.0),)),
        SamplingParams(temperature=1.0, seed=6, allowed_token_ids=(4, 8)),
    )
    np.testing.assert_array_equal(mixed_tokens[:, :2], alone_tokens[:, :2])
    np.testing.assert_array_equal(mixed_lp[:, 1].view(np.uint32), alone_lp[:, 1].view(np.uint32))
    assert (mixed_tokens[:, 2] == 33).all()
    assert set(mixed_tokens[:, 3].tolist()) <= {4, 8}


def test_a_chunked_prompt_samples_its_first_token_under_the_bias_and_mask(tiny_checkpoint_of):
    """The first token of a prompt prefilled in chunks (the pieces path) obeys them too."""
    from engine.engine import Engine, EngineConfig

    folder = tiny_checkpoint_of("llama")
    engine = Engine(EngineConfig(folder, max_slots=1, max_model_len=128, prefill_chunk=32))
    long_prompt = [(31 * i + 7) % engine.vocab_size for i in range(80)]
    assert len(long_prompt) > engine.prefill_buckets[-1]
    biased = SamplingParams(temperature=0.0, seed=1, logit_bias=((55, 100.0),))
    assert run(engine, biased, long_prompt, steps=2) == [55] * 3
    masked = SamplingParams(temperature=1.0, seed=2, allowed_token_ids=(6, 60))
    assert set(run(engine, masked, long_prompt, steps=2)) <= {6, 60}
