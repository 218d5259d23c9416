"""The official `openai` package against a real server: what SDK users see."""

from __future__ import annotations

import math

import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer, pick_stop

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == 128


def test_completion_greedy_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    finishes = [c.choices[0].finish_reason for c in text_chunks]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_greedy_stream_equals_whole(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_max_completion_tokens_limits_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count"}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n_and_multiple_prompts_sum_usage(client: openai.OpenAI) -> None:
    prompts = ["One two", "Three four five"]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 4 * 5
    singles = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=1, temperature=0)
        for p in prompts
    ]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = run(1234)
    assert run(1234) == first
    assert run(99) != first


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    stop = pick_stop(full, 2)
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert value <= 0 and 1 <= len(top) <= 4
        assert all(v <= 0 for v in top.values())
    # greedy: the chosen token is the most likely one
    for token, value, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:],
                                 lp.top_logprobs[n_prompt:], strict=True):  # fmt: skip
        assert math.isclose(value, max(top.values()), rel_tol=1e-5)
        assert top[token] == value
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_zero_max_tokens_scores_the_prompt(client: openai.OpenAI) -> None:
    """lm-eval's log-likelihood request: only the prompt, with its logprobs."""
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == out.usage.prompt_tokens
    assert out.usage.completion_tokens == 0


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", "replace") == out.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, rel_tol=1e-5)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


def test_chat_n_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Two of them"}]}],
            n=2,
            max_tokens=4,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    for index in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])


def test_sampling_extras_reach_the_engine(client: openai.OpenAI) -> None:
    def text(**kwargs: object) -> str:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=16,
            extra_body={"ignore_eos": True, **kwargs.pop("extra", {})},  # type: ignore[dict-item]
            **kwargs,  # type: ignore[arg-type]
        )
        return out.choices[0].text

    greedy = text(temperature=0)
    # top_k=1 at full temperature is greedy again
    assert text(temperature=1.0, seed=11, extra={"top_k": 1}) == greedy
    # a strong frequency penalty changes a greedy run of a tiny model that repeats itself
    assert text(temperature=0, frequency_penalty=2.0) != greedy
