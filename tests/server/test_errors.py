"""Every bad input gets its 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.harness import MAX_MODEL_LEN, LiveServer

OK_PROMPT = {"prompt": "Hi", "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (case name, path, body, expected status, expected param or None)
CASES = [
    ("n zero", "/completions", {**OK_PROMPT, "n": 0}, 400, "n"),
    ("n above max_n", "/completions", {**OK_PROMPT, "n": 1000}, 400, "n"),
    ("negative max_tokens", "/completions", {**OK_PROMPT, "max_tokens": -1}, 400, "max_tokens"),
    ("negative temperature", "/completions", {**OK_PROMPT, "temperature": -0.5}, 400,
     "temperature"),
    ("top_p zero", "/completions", {**OK_PROMPT, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/completions", {**OK_PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("logprobs above 20", "/completions", {**OK_PROMPT, "logprobs": 21}, 400, "logprobs"),
    ("wrong type", "/completions", {**OK_PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt missing", "/completions", {"max_tokens": 2}, 400, "prompt"),
    ("prompt wrong type", "/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("empty prompt list", "/completions", {"prompt": []}, 400, "prompt"),
    ("token id out of vocab", "/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("suffix", "/completions", {**OK_PROMPT, "suffix": "end"}, 400, "suffix"),
    ("best_of above n", "/completions", {**OK_PROMPT, "best_of": 3}, 400, "best_of"),
    ("logit_bias key not an id", "/completions", {**OK_PROMPT, "logit_bias": {"one": 5}}, 400,
     "logit_bias"),
    ("logit_bias key not an integer", "/completions", {**OK_PROMPT, "logit_bias": {"1.5": 5}},
     400, "logit_bias"),
    ("logit_bias id out of vocab", "/completions",
     {**OK_PROMPT, "logit_bias": {"1000000": 5}}, 400, "logit_bias"),
    ("logit_bias negative id", "/completions", {**OK_PROMPT, "logit_bias": {"-1": 5}}, 400,
     "logit_bias"),
    ("logit_bias above 100", "/completions", {**OK_PROMPT, "logit_bias": {"1": 100.5}}, 400,
     "logit_bias"),
    ("logit_bias below -100", "/completions", {**OK_PROMPT, "logit_bias": {"1": -101}}, 400,
     "logit_bias"),
    ("logit_bias not a number", "/completions", {**OK_PROMPT, "logit_bias": {"1": "5"}}, 400,
     "logit_bias"),
    ("logit_bias over 300 entries", "/completions",
     {**OK_PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("logit_bias same id twice", "/completions",
     {**OK_PROMPT, "logit_bias": {"1": 1, "01": 2}}, 400, "logit_bias"),
    ("allowed_token_ids empty", "/completions", {**OK_PROMPT, "allowed_token_ids": []}, 400,
     "allowed_token_ids"),
    ("allowed_token_ids out of vocab", "/completions",
     {**OK_PROMPT, "allowed_token_ids": [5, 10**6]}, 400, "allowed_token_ids"),
    ("allowed_token_ids negative", "/completions", {**OK_PROMPT, "allowed_token_ids": [-3]},
     400, "allowed_token_ids"),
    ("allowed_token_ids not ints", "/completions",
     {**OK_PROMPT, "allowed_token_ids": ["5"]}, 400, "allowed_token_ids"),
    ("stream_options without stream", "/completions",
     {**OK_PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("too many stop strings", "/completions", {**OK_PROMPT, "stop": ["a"] * 17}, 400, "stop"),
    ("stop string too long", "/completions", {**OK_PROMPT, "stop": "x" * 300}, 400, "stop"),
    ("empty stop string", "/completions", {**OK_PROMPT, "stop": [""]}, 400, "stop"),
    ("context exceeded", "/completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN * 2},
     400, "max_tokens"),
    ("prompt too long", "/completions",
     {"prompt": list(range(5, 5 + MAX_MODEL_LEN)), "max_tokens": 1}, 400, "prompt"),
    ("unknown model", "/completions", {**OK_PROMPT, "model": "gpt-9"}, 404, "model"),
    ("chat messages missing", "/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat empty messages", "/chat/completions", {"messages": []}, 400, "messages"),
    ("chat bad role", "/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat image part", "/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("chat tools", "/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("chat top_logprobs without logprobs", "/chat/completions", {**OK_CHAT, "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat top_logprobs above 20", "/chat/completions",
     {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat logit_bias out of vocab", "/chat/completions",
     {**OK_CHAT, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("chat allowed_token_ids empty", "/chat/completions", {**OK_CHAT, "allowed_token_ids": []},
     400, "allowed_token_ids"),
    ("chat negative max_completion_tokens", "/chat/completions",
     {**OK_CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
]  # fmt: skip


def assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_clear_error(
    live: LiveServer, name: str, path: str, body: dict, status: int, param: str | None
) -> None:
    response = httpx.post(live.v1 + path, json=body, timeout=30)
    error = assert_error_shape(response, status)
    if param is not None:
        assert error["param"] == param, error


def test_context_error_states_both_numbers(live: LiveServer) -> None:
    response = httpx.post(
        live.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 1000}, timeout=30
    )
    message = assert_error_shape(response, 400)["message"]
    assert str(MAX_MODEL_LEN) in message and "1000" in message


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"", b'"just a string"'],
    ids=["malformed", "invalid utf-8", "array", "empty", "string"],
)
def test_unparseable_bodies_are_400(live: LiveServer, raw: bytes) -> None:
    response = httpx.post(
        live.v1 + "/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert_error_shape(response, 400)


def test_unknown_route_and_method(live: LiveServer) -> None:
    assert_error_shape(httpx.get(live.v1 + "/nothing", timeout=30), 404)
    assert_error_shape(httpx.get(live.v1 + "/completions", timeout=30), 405)


def test_body_size_limit_names_the_limit(live: LiveServer) -> None:
    huge = json.dumps({"prompt": "x" * (live.config.max_request_bytes + 10)})
    response = httpx.post(
        live.v1 + "/completions",
        content=huge,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert "max_request_bytes" in assert_error_shape(response, 400)["message"]


def test_still_serving_after_errors(live: LiveServer) -> None:
    for _, path, body, _, _ in CASES[:5]:
        httpx.post(live.v1 + path, json=body, timeout=30)
    response = httpx.post(live.v1 + "/completions", json=OK_PROMPT, timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_request_id_is_echoed_or_made(live: LiveServer) -> None:
    given = httpx.post(
        live.v1 + "/completions", json=OK_PROMPT, headers={"X-Request-Id": "abc-123"}, timeout=30
    )
    assert given.headers["x-request-id"] == "abc-123"
    made = httpx.post(live.v1 + "/completions", json=OK_PROMPT, timeout=30)
    assert len(made.headers["x-request-id"]) >= 16


def test_max_tokens_past_the_room_left_is_cut_to_it(live: LiveServer) -> None:
    """vLLM's rule: max_tokens up to the context is taken, and the context's end stops the
    reply ("length"); only max_tokens past the whole context is a 400 (above)."""
    prompt = list(range(5, 5 + MAX_MODEL_LEN - 3))  # three positions left
    body = {"prompt": prompt, "max_tokens": MAX_MODEL_LEN, "ignore_eos": True}
    out = httpx.post(live.v1 + "/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 3
    assert out.json()["choices"][0]["finish_reason"] == "length"
