"""vLLM's endpoints beside OpenAI's, through a real server (issue 28, item 5): /version,
/tokenizer_info behind --enable-tokenizer-info-endpoint, SageMaker's /ping and
/invocations (a chat or a completion body, told apart by its shape), and
/v1/chat/completions/batch (one choice per conversation)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread

MESSAGES = [{"role": "user", "content": "Say something."}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve_in_thread(make_config(tiny_checkpoint, enable_tokenizer_info_endpoint=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def post(server: LiveServer, path: str, body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_version(server: LiveServer) -> None:
    body = httpx.get(server.base_url + "/version", timeout=10).json()
    assert isinstance(body["version"], str) and body["version"]


def test_ping_is_health(server: LiveServer) -> None:
    for method in ("GET", "POST"):
        response = httpx.request(method, server.base_url + "/ping", timeout=10)
        assert response.status_code == 200, method


def test_tokenizer_info_behind_its_flag(server: LiveServer, live: LiveServer) -> None:
    info = httpx.get(server.base_url + "/tokenizer_info", timeout=10)
    assert info.status_code == 200
    body = info.json()
    assert body["tokenizer_class"] and "chat_template" in body
    assert not any(key.endswith("_file") for key in body)  # no server paths
    off = httpx.get(live.base_url + "/tokenizer_info", timeout=10)  # the flag's default: off
    assert off.status_code == 404 and off.json()["error"]["type"] == "not_found_error"


def test_invocations_routes_by_body_shape(server: LiveServer, client: openai.OpenAI) -> None:
    chat_body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    chat = post(server, "/invocations", chat_body).json()
    direct = client.chat.completions.create(model=MODEL_NAME, **chat_body)  # type: ignore[arg-type]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == direct.choices[0].message.content
    completion_body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    completion = post(server, "/invocations", completion_body).json()
    assert completion["object"] == "text_completion"
    want = client.completions.create(model=MODEL_NAME, **completion_body)  # type: ignore[arg-type]
    assert completion["choices"][0]["text"] == want.choices[0].text
    streamed = post(server, "/invocations", {**completion_body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("body", "param"),
    [({"input": "neither"}, None), ([1, 2], None),
     ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
     ({"prompt": "x", "n": 0}, "n")],
    ids=["neither", "not-an-object", "bad-chat", "bad-completion"],
)  # fmt: skip
def test_invocations_errors_are_400s(server: LiveServer, body: object, param: str | None) -> None:
    response = post(server, "/invocations", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param, error
    if param is None:
        assert "Cannot find suitable handler" in error["message"]


def test_batch_answers_each_conversation(server: LiveServer, client: openai.OpenAI) -> None:
    common = {"max_tokens": 5, "temperature": 0, "return_token_ids": True}
    batch = post(server, "/v1/chat/completions/batch", {"messages": [MESSAGES, OTHER], **common})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for choice, messages in zip(body["choices"], (MESSAGES, OTHER), strict=True):
        one = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        )  # fmt: skip
        assert choice["message"]["content"] == one.choices[0].message.content
        assert choice["finish_reason"] == one.choices[0].finish_reason
        assert len(choice["token_ids"]) == one.usage.completion_tokens
        usage["prompt_tokens"] += one.usage.prompt_tokens
        usage["completion_tokens"] += one.usage.completion_tokens
    assert {k: body["usage"][k] for k in usage} == usage


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 2}, "n"), ({"stream": True}, "stream"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
     ({"messages": [MESSAGES, []]}, "messages"), ({"messages": []}, "messages")],
    ids=["n", "stream", "tools", "empty-conversation", "no-conversation"],
)  # fmt: skip
def test_batch_refusals_name_the_field(server: LiveServer, extra: dict, param: str) -> None:
    response = post(server, "/v1/chat/completions/batch", {"messages": [MESSAGES], **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
