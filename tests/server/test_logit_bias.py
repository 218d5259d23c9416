"""logit_bias (OpenAI's) and allowed_token_ids (vLLM's) through the real server and the
official openai client, on completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hi!"}]
TOKENS = 6


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def words(live: LiveServer) -> dict[int, str]:
    """Token id -> its text, for the words of PROMPT (whole-word tokens of the tiny tokenizer)."""
    body = {"prompt": PROMPT, "add_special_tokens": False}
    ids = httpx.post(live.base_url + "/tokenize", json=body, timeout=30).json()["tokens"]
    return {i: detokenize(live, [i]) for i in ids}


def detokenize(live: LiveServer, ids: list[int]) -> str:
    response = httpx.post(live.base_url + "/detokenize", json={"tokens": ids}, timeout=30)
    return response.json()["prompt"]


def completion_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str | None]:
    """(text, finish_reason) of one completion, streamed or not."""
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": TOKENS, **kwargs}
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str | None]:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": TOKENS, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", [completion_text, chat_text], ids=["completions", "chat"])
def test_a_plus_100_bias_picks_that_token_every_time(
    client: openai.OpenAI, live: LiveServer, words: dict[int, str], endpoint, stream: bool
) -> None:
    token = list(words)[-1]
    text, finish = endpoint(client, stream, temperature=0, logit_bias={str(token): 100})
    assert text == detokenize(live, [token] * TOKENS)
    assert finish == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", [completion_text, chat_text], ids=["completions", "chat"])
def test_allowed_token_ids_restrict_every_token(
    client: openai.OpenAI, live: LiveServer, words: dict[int, str], endpoint, stream: bool
) -> None:
    allowed = list(words)
    one, finish = endpoint(
        client, stream, temperature=0, extra_body={"allowed_token_ids": [allowed[1]]}
    )
    assert one == detokenize(live, [allowed[1]] * TOKENS) and finish == "length"
    text, _ = endpoint(
        client, stream, temperature=1.0, seed=3, extra_body={"allowed_token_ids": allowed}
    )
    rest = text
    while rest:  # the text is a concatenation of the allowed words
        word = next((w for w in words.values() if w and rest.startswith(w)), None)
        assert word is not None, (text, words)
        rest = rest[len(word) :]


def test_n_samples_each_get_the_mask_and_logprobs_stay_raw(
    client: openai.OpenAI, words: dict[int, str]
) -> None:
    allowed = list(words)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=TOKENS,
        n=3,
        seed=11,
        logprobs=2,
        extra_body={"allowed_token_ids": allowed},
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert set(choice.logprobs.tokens) <= set(words.values())
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2
    )
    biased = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=2,
        logit_bias={str(allowed[0]): 100},
    )
    # logprobs are the model's (raw, vLLM's default): the same alternatives, and the biased
    # pick keeps its unbiased logprob (it was no favourite of the model's)
    top = biased.choices[0].logprobs.top_logprobs[0]
    assert plain.choices[0].logprobs.top_logprobs[0].items() <= top.items()
    assert biased.choices[0].logprobs.tokens == [words[allowed[0]]]
    assert biased.choices[0].logprobs.token_logprobs[0] < max(top.values())


def test_bad_bias_is_a_400_the_sdk_raises(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, logit_bias={"1": 101})
    assert info.value.body["param"] == "logit_bias"
