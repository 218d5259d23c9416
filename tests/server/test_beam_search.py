"""vLLM's beam search through the real server (tiny random model) and the openai client.

Its choices equal a reference beam search written here over the model's next-token
logprobs (read through another path: the prompt logprobs of each prefix); the search's
rules (EOS completes a beam, length penalty, early stopping, the EOS token in the ids
only with include_stop_str_in_output) on hand-made steps; its errors as vLLM's.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from engine.types import TokenLogprobs
from server.beam import BeamSearch, as_delta
from server.beam_plan import BeamSettings
from server.params import PromptInput
from tests.server.harness import MODEL_NAME, LiveServer

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=300)


def next_logprobs(live: LiveServer, prefix: list[int]) -> list[tuple[int, float]]:
    """The model's 20 most likely next tokens after `prefix`, best first: the prompt
    logprobs of the position after it (any token stands in for the next one)."""
    body = {"model": MODEL_NAME, "prompt": [*prefix, 0], "max_tokens": 1, "prompt_logprobs": 20}
    response = httpx.post(live.v1 + "/completions", json=body, timeout=120)
    position = response.json()["choices"][0]["prompt_logprobs"][-1]
    ranked = sorted((e["rank"], int(t), e["logprob"]) for t, e in position.items() if e["rank"])
    return [(token, logprob) for _, token, logprob in ranked]


def reference(
    live: LiveServer, prompt: list[int], width: int, steps: int, penalty: float, eos: set[int]
) -> list[tuple[list[int], float]]:
    """Textbook beam search (vLLM's rules): each beam grows by its 2 x width best tokens,
    EOS completes one, the width best by summed logprob go on; the end ranks completed
    and live beams by sum / (prompt + tokens but EOS) ** penalty."""
    live_beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, bool]] = []
    for _ in range(steps):
        grown = []
        for tokens, total in live_beams:
            for token, logprob in next_logprobs(live, prompt + tokens)[: 2 * width]:
                if token in eos:
                    done.append((tokens + [token], total + logprob, True))
                else:
                    grown.append((tokens + [token], total + logprob))
        live_beams = sorted(grown, key=lambda b: -b[1])[:width]
    ranked = done + [(t, s, False) for t, s in live_beams]

    def score(beam: tuple[list[int], float, bool]) -> float:
        return beam[1] / ((len(prompt) + len(beam[0]) - beam[2]) ** penalty)

    return [(t, s) for t, s, _ in sorted(ranked, key=score, reverse=True)[:width]]


def eos_ids(live: LiveServer) -> set[int]:
    return set(live.app.state.runtime.backend.eos_token_ids)  # type: ignore[attr-defined]


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_completions_beams_equal_a_reference_beam_search(
    client: openai.OpenAI, live: LiveServer, penalty: float
) -> None:
    prompt = httpx.post(live.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    width, steps = 3, 4
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=steps, n=width, logprobs=1,
        extra_body={"use_beam_search": True, "length_penalty": penalty, "return_token_ids": True},
    )  # fmt: skip
    want = reference(live, prompt, width, steps, penalty, eos_ids(live))
    got = [choice.token_ids for choice in out.choices]  # type: ignore[attr-defined]
    assert got == [tokens for tokens, _ in want]
    for choice, (tokens, total) in zip(out.choices, want, strict=True):
        assert choice.logprobs is not None and choice.finish_reason == "length"
        assert math.isclose(sum(choice.logprobs.token_logprobs), total, abs_tol=1e-4)  # type: ignore[arg-type]
        assert choice.text == live.app.state.runtime.backend.tokenizer.decode(tokens)  # type: ignore[attr-defined]
    assert [c.index for c in out.choices] == list(range(width))
    assert out.usage is not None and out.usage.completion_tokens == width * steps


def test_chat_beams_and_a_width_of_one_is_greedy(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
    )
    beams = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert len(beams.choices) == 2 and beams.choices[0].message.role == "assistant"
    one = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    if greedy.choices[0].finish_reason == "length":  # no EOS on the way: the same tokens
        assert one.choices[0].message.content == greedy.choices[0].message.content


def test_steps_after_the_first_take_the_prompt_from_the_prefix_cache(
    client: openai.OpenAI, live: LiveServer
) -> None:
    """Each step is an ordinary request whose prompt is a beam so far: its leading blocks
    are the engine's prefix-cache hits."""
    engine = live.app.state.runtime.backend.engine  # type: ignore[attr-defined]
    before = engine.stats().prefix_hits
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)
    client.completions.create(
        model=MODEL_NAME, prompt=long_prompt, max_tokens=3, n=2,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert engine.stats().prefix_hits > before


def settings(**overrides: Any) -> BeamSettings:
    return BeamSettings(**{"width": 2, "max_tokens": 3, **overrides})


def step(*pairs: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(pairs[0][0], pairs[0][1], pairs)


EOS = 9


def test_eos_completes_a_beam_and_the_length_penalty_ranks_the_ends() -> None:
    """A beam ended by EOS competes at the end by its score; EOS is not counted."""
    search = BeamSearch(prompt_len=2, settings=settings(), eos=frozenset({EOS}), max_steps=2)
    search.expand([step((EOS, -0.5), (1, -1.0), (2, -2.0))])
    assert [b.tokens for b in search.done] == [(EOS,)]
    assert [b.tokens for b in search.live] == [(1,), (2,)]
    search.expand([step((3, -1.0), (EOS, -3.0)), step((4, -0.1), (5, -0.2))])
    assert search.over
    best = search.best()
    # scores: (9,) -0.5 / 2; (2, 4) -2.1 / 4; (2, 5) -2.2 / 4; (1, 3) -2.0 / 4; (1, 9) -4 / 3
    assert [b.tokens for b in best] == [(EOS,), (1, 3)]
    assert best[0].ended and not best[1].ended


def test_early_stopping_ends_once_width_beams_completed() -> None:
    search = BeamSearch(2, settings(early_stopping=True), frozenset({EOS}), max_steps=10)
    search.expand([step((EOS, -0.1), (1, -0.2), (2, -0.3))])
    assert not search.over
    search.expand([step((EOS, -0.1), (3, -0.5)), step((4, -0.1), (5, -0.5))])
    assert search.over and len(search.done) == 2
    patient = BeamSearch(2, settings(), frozenset({EOS}), max_steps=10)
    patient.expand([step((EOS, -0.1), (1, -0.2), (2, -0.3))])
    patient.expand([step((EOS, -0.1), (3, -0.5)), step((4, -0.1), (5, -0.5))])
    assert not patient.over  # vLLM's default: every step up to max_tokens


def test_ignore_eos_keeps_eos_as_a_token() -> None:
    search = BeamSearch(2, settings(ignore_eos=True), frozenset({EOS}), max_steps=1)
    search.expand([step((EOS, -0.1), (1, -0.2))])
    assert not search.done and [b.tokens for b in search.live] == [(EOS,), (1,)]


@pytest.mark.parametrize("include", [False, True])
def test_an_eos_ended_choice_shows_eos_in_its_ids_only_when_asked(
    live: LiveServer, include: bool
) -> None:
    backend = live.app.state.runtime.backend  # type: ignore[attr-defined]
    search = BeamSearch(2, settings(include_stop_str_in_output=include), frozenset({EOS}), 2)
    search.expand([step((5, -0.1), (6, -0.2))])
    search.expand([step((EOS, -0.1), (7, -0.3)), step((8, -0.2))])
    ended = next(b for b in search.best() if b.ended)
    delta = as_delta(backend, search.settings, PromptInput((1, 2), ""), 0, ended)
    assert delta.token_ids == ((5, EOS) if include else (5,))
    assert delta.text == backend.tokenizer.decode([5])  # never the EOS token's text
    assert (delta.finish_reason, delta.stop_reason) == ("stop", EOS)
    assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)


def post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    base: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2, "use_beam_search": True}
    base.update({"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES})
    return httpx.post(live.v1 + path, json={**base, **body}, timeout=60)


BAD = {
    "stream": ({"stream": True}, "use_beam_search", "Streaming is not currently supported"),
    "width": ({"n": 11}, "n", "greater than max allowed: 20"),
    "logprob_token_ids": (
        {"logprob_token_ids": [1], "logprobs": True},
        "logprob_token_ids",
        "not supported with beam search",
    ),
    "stop": ({"stop": ["x"]}, "stop", "not supported with beam search"),
    "constraint": (
        {"response_format": {"type": "json_object"}},
        "use_beam_search",
        "structured outputs",
    ),
}


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_what_beam_search_refuses_is_a_400(live: LiveServer, path: str, case: str) -> None:
    fields, param, named = BAD[case]
    if path == "/completions" and fields.get("logprobs") is True:
        fields = {**fields, "logprobs": 1}
    response = post(live, path, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error


def test_the_sdk_raises_for_a_streamed_beam_search(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="beam search"):
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True,
            extra_body={"use_beam_search": True},
        )  # fmt: skip
