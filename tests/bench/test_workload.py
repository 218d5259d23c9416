"""Workload files: parsing, presets, context fractions, and the prompts they draw."""

from __future__ import annotations

import random

import pytest

from bench.workload import (
    WORKLOAD_DIR,
    Length,
    Requests,
    Vocabulary,
    Workload,
    build_requests,
)


def test_presets_load_and_fit_a_1024_context() -> None:
    names = sorted(p.stem for p in WORKLOAD_DIR.glob("*.json"))
    assert {"chat", "long_prompt", "burst", "random"} <= set(names)
    for name in names:
        Workload.load(name).resolve(1024)


def test_long_prompt_is_three_quarters_of_the_context() -> None:
    w = Workload.load("long_prompt").resolve(1024)
    assert (w.input_tokens.low, w.input_tokens.high) == (768, 768)
    assert w.output_tokens.low == 64 and w.source == "text"


def test_chat_shares_its_system_prompt() -> None:
    w = Workload.load("chat").resolve(1024)
    reqs = build_requests(w, 5, Vocabulary(1000), seed=3)
    prefixes = {r.prompt[:64] for r in reqs}
    assert len(prefixes) == 1
    assert all(64 + 16 <= len(r.prompt) <= 64 + 96 for r in reqs)
    assert len({r.prompt[64:] for r in reqs}) == 5


def test_burst_and_concurrency_send_at_zero_poisson_spreads() -> None:
    burst = Workload.load("burst").resolve(1024)
    assert burst.arrival == "burst" and burst.requests.count(16) == 16
    assert all(r.send_at_s == 0 for r in build_requests(burst, 4, Vocabulary(100)))
    poisson = Workload(
        "p", Length(4, 4), Length(2, 2), arrival="poisson", rate=10.0, requests=Requests()
    )
    offsets = [r.send_at_s for r in build_requests(poisson, 2001, Vocabulary(100), seed=1)]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 2000 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_requests_are_deterministic_and_avoid_special_ids() -> None:
    w = Workload.load("random").resolve(1024)
    vocab = Vocabulary(10, frozenset({0, 1, 2}))
    a, b = build_requests(w, 3, vocab, seed=7), build_requests(w, 3, vocab, seed=7)
    assert a == b and a != build_requests(w, 3, vocab, seed=8)
    assert all(3 <= i < 10 for r in a for i in r.prompt)
    assert all(len(r.prompt) == 128 and r.output_tokens == 128 for r in a)


def test_text_source_slices_the_given_ids() -> None:
    w = Workload("t", Length(5, 5), Length(1, 1), source="text")
    reqs = build_requests(w, 3, Vocabulary(100), seed=0, text_ids=list(range(50, 60)))
    for r in reqs:
        assert len(r.prompt) == 5 and all(50 <= i < 60 for i in r.prompt)
    with pytest.raises(ValueError, match="text_ids"):
        build_requests(w, 1, Vocabulary(100))


def test_request_counts() -> None:
    r = Requests(per_concurrency=4, min=8, max=100)
    assert [r.count(c) for c in (1, 4, 16, 64)] == [8, 16, 64, 100]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prompt": {"tokens": {"fixed": 4}}, "output_tokens": {"fixed": 0}}, "output_tokens"),
        ({"prompt": {"tokens": {"uniform": [9, 3]}}, "output_tokens": {"fixed": 4}}, "low"),
        ({"prompt": {"tokens": {"normal": 3}}, "output_tokens": {"fixed": 4}}, "unknown"),
        (
            {
                "prompt": {"tokens": {"fixed": 4}},
                "output_tokens": {"fixed": 4},
                "arrival": {"mode": "poisson"},
            },
            "rate",
        ),
    ],
)
def test_bad_files_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload.from_dict({"name": "bad", **data})


def test_too_long_for_the_context() -> None:
    with pytest.raises(ValueError, match="exceeds the context"):
        Workload.load("random").resolve(200)


def test_length_draw_uniform_is_inclusive() -> None:
    rng = random.Random(0)
    assert {Length(2, 4).draw(rng) for _ in range(200)} == {2, 3, 4}
