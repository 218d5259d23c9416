"""vLLM's logprob_token_ids through the real server and the official openai client.

At each generated position the logprobs list the sampled token and then each id asked,
once each, whatever `logprobs` / `top_logprobs` says; their values are the bits the
top logprobs give the same ids (one log-softmax of the raw logits, on the device);
streamed equals whole; tokens do not change; every bad value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Say something."}]
AS_IDS = {"return_tokens_as_token_ids": True}  # "token_id:N": names no two tokens share


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def vocab_size(live: LiveServer) -> int:
    return int(live.app.state.runtime.backend.limits.vocab_size)  # type: ignore[attr-defined]


def token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def completion_positions(client: openai.OpenAI, stream: bool, **kwargs: Any) -> list[dict]:
    """Each generated position's top_logprobs as {token id: logprob}, in the reply's order."""
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kwargs}
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        tops = [
            t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs
        ]
    else:
        logprobs = client.completions.create(**kwargs).choices[0].logprobs
        assert logprobs is not None
        tops = list(logprobs.top_logprobs or [])
    return [{token_id(k): v for k, v in (top or {}).items()} for top in tops]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_list_the_sampled_token_then_each_id(
    client: openai.OpenAI, live: LiveServer, stream: bool
) -> None:
    best = completion_positions(client, False, logprobs=20, extra_body=AS_IDS)
    first_best = list(best[0])
    last_id = vocab_size(live) - 1
    asked = [first_best[3], last_id, first_best[1], first_best[3]]  # a repeat is listed once
    picked = completion_positions(
        client, stream, logprobs=1, extra_body={**AS_IDS, "logprob_token_ids": asked}
    )
    assert len(picked) == len(best)
    for top20, position in zip(best, picked, strict=True):
        sampled = next(iter(top20))  # the token first, as in every completions logprobs
        assert list(position) == list(dict.fromkeys([sampled, *asked]))
        for token, logprob in position.items():
            if token in top20:
                assert logprob == top20[token]  # the same bits as the top logprobs give
        assert position[last_id] <= 0


def chat_content(client: openai.OpenAI, stream: bool, **kwargs: Any) -> list[Any]:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
              "logprobs": True, **kwargs}  # fmt: skip
    if not stream:
        logprobs = client.chat.completions.create(**kwargs).choices[0].logprobs
        assert logprobs is not None
        return list(logprobs.content or [])
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    return [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_lists_the_sampled_token_then_each_id(client: openai.OpenAI, stream: bool) -> None:
    best = chat_content(client, False, top_logprobs=20, extra_body=AS_IDS)
    values = [{token_id(t.token): t.logprob for t in entry.top_logprobs} for entry in best]
    asked = [list(values[0])[2], 0, list(values[0])[0]]
    picked = chat_content(
        client, stream, top_logprobs=5, extra_body={**AS_IDS, "logprob_token_ids": asked}
    )
    assert [e.token for e in picked] == [e.token for e in best]  # the tokens do not change
    for entry, top20 in zip(picked, values, strict=True):
        sampled = token_id(entry.token)
        listed = [token_id(t.token) for t in entry.top_logprobs]
        assert listed == list(dict.fromkeys([sampled, *asked]))
        assert entry.top_logprobs[0].logprob == entry.logprob
        for t in entry.top_logprobs:
            if token_id(t.token) in top20:
                assert t.logprob == top20[token_id(t.token)]
            assert t.bytes is not None


def test_n_samples_and_other_rows_leave_the_values_unchanged(client: openai.OpenAI) -> None:
    """n samples of two prompts in one batch: each row's values are those it gets alone."""
    extra = {**AS_IDS, "logprob_token_ids": [5, 7, 11]}
    alone = completion_positions(client, False, logprobs=0, extra_body=extra)
    out = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Hello there"], max_tokens=6, temperature=0,
        logprobs=0, n=2, extra_body=extra,
    )  # fmt: skip
    for choice in out.choices[:2]:  # the first prompt's two greedy samples
        assert choice.logprobs is not None
        got = [
            {token_id(k): v for k, v in (t or {}).items()}
            for t in choice.logprobs.top_logprobs or []
        ]
        assert got == alone


def post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    base = {"model": MODEL_NAME, "max_tokens": 2}
    base.update({"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES})
    return httpx.post(live.v1 + path, json={**base, **body}, timeout=60)


BAD = {
    "empty": ({"logprob_token_ids": []}, "empty"),
    "too_many": ({"logprob_token_ids": list(range(129))}, "max allowed: 128"),
    "out_of_vocab": ({"logprob_token_ids": [3, 10**6, -1]}, "[1000000, -1]"),
    "not_ints": ({"logprob_token_ids": ["1"]}, "logprob_token_ids"),
    "without_logprobs": ({"logprob_token_ids": [3], "logprobs": None}, "`logprobs` must be set"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_logprob_token_ids_are_400s_naming_the_field(
    live: LiveServer, case: str, path: str, stream: bool
) -> None:
    fields, named = BAD[case]
    logprobs = {"logprobs": 1} if path == "/completions" else {"logprobs": True}
    body = {**logprobs, **fields, "stream": stream}
    if body.get("logprobs") is None:
        body.pop("logprobs")
    response = post(live, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logprob_token_ids" and error["type"] == "invalid_request_error"
    assert named in error["message"], error


def test_chat_needs_logprobs_true(live: LiveServer) -> None:
    response = post(live, "/chat/completions", {"logprobs": False, "logprob_token_ids": [3]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprob_token_ids"


def test_echo_without_generation_is_a_400(live: LiveServer) -> None:
    body = {"echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [3]}
    response = post(live, "/completions", body)
    assert response.status_code == 400, response.text
    assert "no output tokens" in response.json()["error"]["message"]
