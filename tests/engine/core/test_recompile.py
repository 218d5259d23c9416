"""After the runner's warm-up, nothing a step can be asked to do compiles anything: every
batch shape, prompt chunks beside decode rows, prompt logprobs, logit bias, allowed
token ids, grammar masks, penalties, seeded sampling, and a preempted sequence's
rebuilt penalty counts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import jax
import numpy as np
import pytest

from engine.core.core import CoreConfig, EngineCore
from engine.core.scheduler import SequenceState
from engine.types import SamplingParams
from tests.engine.core.test_core import Only

TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/backend_compile_duration",
)


@pytest.fixture
def compile_events() -> Iterator[list[str]]:
    """Names of jax tracing / compilation events recorded while the test runs."""
    events: list[str] = []
    recording = [True]

    def listener(event: str, duration: float, **_: object) -> None:
        if recording[0] and event in TRACE_EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    recording[0] = False


@pytest.mark.parametrize("speculation", [None, "ngram", "draft_model"])
def test_serving_after_warmup_compiles_nothing(
    tiny_checkpoint_of, compile_events, speculation
) -> None:  # type: ignore[no-untyped-def]
    """...with speculation too: drafts, their grammar masks, and a draft model's steps."""
    folder = tiny_checkpoint_of("llama")
    spec = None
    if speculation == "ngram":
        spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    elif speculation == "draft_model":
        spec = json.dumps(
            {"method": speculation, "model": str(folder), "num_speculative_tokens": 2}
        )
    core = EngineCore(
        CoreConfig(
            model_path=folder,
            max_num_seqs=4,
            max_model_len=96,
            max_num_batched_tokens=32,
            chunk_size=16,
            page_size=8,
            num_pages=14,
            speculative_config=spec,
        )  # fmt: skip
    )
    core.warmup()
    compile_events.clear()
    vocab = core.model_config.vocab_size
    rng = np.random.default_rng(0)
    samplings = [
        SamplingParams(temperature=0.0, seed=1, logit_bias=((5, 100.0),)),
        SamplingParams(temperature=0.0, seed=2, allowed_token_ids=(3, 4), logprobs=3),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=3, presence_penalty=0.5),
        replace(SamplingParams(temperature=1.0, seed=4), constraint=Only([7, 8], 6, vocab)),
        SamplingParams(temperature=0.7, seed=5, frequency_penalty=1.0, min_tokens=3),
    ]
    for length in (1, 5, 17, 40, 70):  # one chunk, several, beside decode rows
        for i, sampling in enumerate(samplings):
            prompt = tuple(rng.integers(3, vocab, length).tolist())
            core.add(
                SequenceState(f"{length}-{i}", prompt, sampling, 12, prompt_logprobs=i % 2 or None)
            )
    while core.scheduler.busy:
        core.step()
    assert core.scheduler.preemptions > 0  # 14 pages for 4 rows: rebuilt counts ran too
    if speculation is not None:
        assert core.scheduler.speculator.counters.drafts > 0  # type: ignore[union-attr]
    assert compile_events == []


def test_the_listener_sees_a_compilation(compile_events) -> None:  # type: ignore[no-untyped-def]
    jax.jit(lambda x: x * 3 + 1)(np.arange(7))
    assert compile_events
