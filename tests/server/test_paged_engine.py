"""The engine core over paged KV (the default engine, in its own process) through a real
uvicorn socket to the openai SDK, beside the slot engine on the same tiny checkpoint: the
same greedy text, streamed or whole, n samples, logprobs and stop strings."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer, make_config, pick_stop, serve_in_thread

PROMPTS = ["The quick brown fox", "Once upon a time there was", "a b c d e f g h i j k l m"]


@pytest.fixture(scope="module")
def paged(tiny_checkpoint) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    config = make_config(tiny_checkpoint, engine="paged", max_num_batched_tokens=64, page_size=8)
    with serve_in_thread(config) as server:
        yield server


@pytest.fixture(scope="module")
def slot(tiny_checkpoint) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    with serve_in_thread(make_config(tiny_checkpoint, engine="slot")) as server:
        yield server


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def test_greedy_text_matches_the_slot_engine(paged: LiveServer, slot: LiveServer) -> None:
    ours, slot_client = client_of(paged), client_of(slot)
    for prompt in PROMPTS:
        args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        got = ours.completions.create(**args)  # type: ignore[call-overload]
        want = slot_client.completions.create(**args)  # type: ignore[call-overload]
        assert got.choices[0].text == want.choices[0].text, prompt
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage == want.usage
        streamed = ours.completions.create(**args, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.choices[0].text


def test_all_prompts_at_once_with_n_and_logprobs(paged: LiveServer) -> None:
    client = client_of(paged)
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0, n=2, logprobs=3
    )
    assert len(whole.choices) == 6
    by_prompt = {}
    for choice in whole.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs)
        assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
        by_prompt.setdefault(choice.index // 2, set()).add(choice.text)
    assert all(len(texts) == 1 for texts in by_prompt.values())  # greedy: both samples agree
    seeded = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**seeded)  # type: ignore[call-overload]
    again = client.completions.create(**seeded)  # type: ignore[call-overload]
    assert first.choices[0].text == again.choices[0].text


def test_stop_string_ends_the_sample(paged: LiveServer) -> None:
    client = client_of(paged)
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16,
                                     temperature=0)  # fmt: skip
    stop = pick_stop(free.choices[0].text, 3)
    cut = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert free.choices[0].text.startswith(cut.choices[0].text)
