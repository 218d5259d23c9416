"""The orchestrator on the real JAX engine with a tiny random checkpoint and its real tokenizer.

Greedy outputs must not depend on what else shares the batch, and EOS, stop
token ids, stop strings and max_tokens must end requests with the right
finish_reason and text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.orchestrator import Orchestrator
from engine.request import ActiveRequest, Delta
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams
from tokenization import Tokenizer

SLOTS = 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Any:
    from engine.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(model_path=str(tiny_checkpoint), max_slots=SLOTS, max_model_len=128)
    )
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_checkpoint)


@pytest.fixture
def orch(engine: Any, tokenizer: Tokenizer) -> Iterator[Orchestrator]:
    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids))
    o.start()
    yield o
    o.stop()


def prompts(tokenizer: Tokenizer, count: int) -> list[tuple[int, ...]]:
    rng = random.Random(0)
    words = ("the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "town")
    out = []
    for i in range(count):
        length = 1 + (i * 7) % 40  # 1..40 words: several prefill buckets
        out.append(tuple(tokenizer.encode(" ".join(rng.choice(words) for _ in range(length)))))
    return out


def run(o: Orchestrator, rid: str, prompt: tuple[int, ...], **kw: Any) -> list[Delta]:
    kw.setdefault("sampling", GREEDY)
    return o.submit(ActiveRequest(request_id=rid, prompt_ids=prompt, **kw)).collect(timeout=60)


def token_ids(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def test_concurrent_greedy_requests_match_their_solo_runs(
    orch: Orchestrator, tokenizer: Tokenizer
) -> None:
    cases = prompts(tokenizer, 3 * SLOTS)
    assert len({len(p) for p in cases}) > 4
    alone = [run(orch, f"solo{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(cases)]
    streams = [
        orch.submit(ActiveRequest(f"r{i}", p, GREEDY, max_tokens=10, ignore_eos=True))
        for i, p in enumerate(cases)
    ]
    together = [s.collect(timeout=60) for s in streams]
    for solo, both in zip(alone, together, strict=True):
        assert token_ids(both) == token_ids(solo) and len(token_ids(solo)) == 10
        assert text(both) == text(solo) == tokenizer.decode(token_ids(solo))
        assert both[-1].finish_reason == "length"


def test_finish_reasons_on_the_real_engine(
    engine: Any, tokenizer: Tokenizer, orch: Orchestrator
) -> None:
    prompt = prompts(tokenizer, 5)[4]
    ref = run(orch, "ref", prompt, max_tokens=24, ignore_eos=True)
    ref_ids = token_ids(ref)
    eos_ids = frozenset(tokenizer.eos_token_ids) | engine.eos_token_ids
    assert not eos_ids & set(ref_ids[:3]), "the random model emitted EOS early; pick a seed"

    cut = next(k for k in range(2, 24) if ref_ids[k] not in ref_ids[:k])
    stopped = run(orch, "stop-id", prompt, max_tokens=24, stop_token_ids=(ref_ids[cut],))
    assert token_ids(stopped) == ref_ids[: cut + 1]
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", ref_ids[cut])
    assert text(stopped) == tokenizer.decode(ref_ids[:cut])

    full_text = text(ref)
    stop = full_text.strip()[3:6]
    by_string = run(orch, "stop-str", prompt, max_tokens=24, stop=(stop,))
    assert (by_string[-1].finish_reason, by_string[-1].stop_reason) == ("stop", stop)
    assert text(by_string) == full_text[: full_text.index(stop)]

    short = run(orch, "length", prompt, max_tokens=5)
    assert token_ids(short) == ref_ids[:5]
    assert (short[-1].finish_reason, short[-1].completion_tokens) == ("length", 5)

    o = Orchestrator(engine, text_streams(tokenizer.detokenizer, {ref_ids[cut]}))
    o.start()
    try:
        by_eos = run(o, "eos", prompt, max_tokens=24)
        assert token_ids(by_eos) == ref_ids[: cut + 1]
        assert (by_eos[-1].finish_reason, by_eos[-1].stop_reason) == ("stop", None)
        assert text(by_eos) == tokenizer.decode(ref_ids[:cut])
        ignored = run(o, "no-eos", prompt, max_tokens=24, ignore_eos=True)
        assert token_ids(ignored) == ref_ids
    finally:
        o.stop()


def test_seeded_samples_do_not_depend_on_the_batch(
    orch: Orchestrator, tokenizer: Tokenizer
) -> None:
    prompt = prompts(tokenizer, 3)[2]
    sampling = SamplingParams(temperature=1.0, seed=1234)
    alone = run(orch, "alone", prompt, sampling=sampling, max_tokens=8, ignore_eos=True)
    deltas = run(orch, "n3", prompt, sampling=sampling, max_tokens=8, n=3, ignore_eos=True)
    samples = [[t for d in deltas if d.index == i for t in d.token_ids] for i in range(3)]
    assert samples[0] == token_ids(alone)
    assert len({tuple(s) for s in samples}) > 1  # other samples follow other seeds


def test_greedy_logprobs_come_back_per_token(orch: Orchestrator, tokenizer: Tokenizer) -> None:
    prompt = prompts(tokenizer, 2)[1]
    sampling = SamplingParams(temperature=0.0, logprobs=2)
    deltas = run(orch, "lp", prompt, sampling=sampling, max_tokens=6, prompt_logprobs=2)
    for d in deltas:
        (token,) = d.token_ids
        (lp,) = d.logprobs or ()
        assert lp.token_id == token and len(lp.top) == 2
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1], abs=1e-5)
        assert lp.top[0][1] >= lp.top[1][1] and lp.logprob <= 0
    echo = deltas[0].prompt_logprobs
    assert echo is not None and len(echo) == len(prompt) and echo[0] is None
    assert [e.token_id for e in echo[1:] if e is not None] == list(prompt[1:])
