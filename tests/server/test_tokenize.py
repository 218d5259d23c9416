"""POST /tokenize and /detokenize in vLLM's shape, through the real server.

Token ids are compared with what the checkpoint's own tokenizer gives for the same
input, so the endpoints neither add nor lose a token; a chat's count is the one
/v1/chat/completions bills for the same messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.harness import MAX_MODEL_LEN, MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.scripted import RecordingTokenizer, ScriptedEngine, delta, scripted_backend
from tokenization import Tokenizer

TEXT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
KEY = "sk-tokenize-test"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_checkpoint)


def post(live: LiveServer, path: str, body: object) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=60)


def test_prompt_tokens_are_the_tokenizers(live: LiveServer, tokenizer: Tokenizer) -> None:
    out = post(live, "/tokenize", {"model": MODEL_NAME, "prompt": TEXT})
    assert out.status_code == 200
    ids = tokenizer.encode(TEXT)
    assert out.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    assert ids[0] == tokenizer.bos_token_id  # add_special_tokens defaults to true
    bare = post(live, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False) == ids[1:]


def test_chat_tokens_are_what_chat_completions_bills(
    live: LiveServer, tokenizer: Tokenizer
) -> None:
    out = post(live, "/tokenize", {"messages": CHAT}).json()
    assert out["tokens"] == tokenizer.apply_chat_template(CHAT)  # generation prompt by default
    chat = post(live, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert out["count"] == chat["usage"]["prompt_tokens"]


def test_chat_options(live: LiveServer, tokenizer: Tokenizer) -> None:
    body = {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}
    out = post(live, "/tokenize", body).json()
    text = tokenizer.render_chat(CHAT, add_generation_prompt=False)
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert out["tokens"] != tokenizer.apply_chat_template(CHAT)
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    joined = post(live, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()
    assert joined["tokens"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi\nthere"}]
    )


def test_continue_final_message(live: LiveServer, tokenizer: Tokenizer) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Once upon a"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    out = post(live, "/tokenize", body).json()
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    assert out["tokens"] == tokenizer.apply_chat_template(messages, **kwargs)
    tail = tokenizer.encode("Once upon a", add_special_tokens=False)
    assert out["tokens"][-len(tail) :] == tail  # no end-of-turn after the content


def test_detokenize_is_the_tokenizers_decode(live: LiveServer, tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template(CHAT)
    out = post(live, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert out.status_code == 200
    assert out.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert out.json()["prompt"].startswith("<s>")  # special tokens kept, as vLLM decodes
    assert post(live, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    round_trip = post(live, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert post(live, "/detokenize", {"tokens": round_trip["tokens"]}).json()["prompt"] == TEXT


LONE_SURROGATE = b'{"prompt": "a\\ud800b"}'

CASES = [
    ("id outside the vocabulary", "/detokenize", {"tokens": [1, 512]}, 400, "tokens"),
    ("negative id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("id as a string", "/detokenize", {"tokens": ["5"]}, 400, "tokens"),
    ("id as a bool", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("tokens missing", "/detokenize", {}, 400, "tokens"),
    ("unknown model (detokenize)", "/detokenize", {"model": "gpt-9", "tokens": [1]}, 404,
     "model"),
    ("unknown model (tokenize)", "/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("neither prompt nor messages", "/tokenize", {"model": MODEL_NAME}, 400, "prompt"),
    ("both prompt and messages", "/tokenize", {"prompt": "x", "messages": CHAT}, 400,
     "messages"),
    ("prompt not a string", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("empty messages", "/tokenize", {"messages": []}, 400, "messages"),
    ("image part", "/tokenize",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("continue after a user message", "/tokenize",
     {"messages": CHAT, "continue_final_message": True}, 400, "messages"),
    ("continue with a generation prompt", "/tokenize",
     {"messages": [*CHAT, {"role": "assistant", "content": "x"}],
      "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("return_token_strs", "/tokenize", {"prompt": "x", "return_token_strs": True}, 400,
     "return_token_strs"),
    ("body not an object", "/tokenize", ["x"], 400, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_an_openai_error(
    live: LiveServer, path: str, body: object, status: int, param: str | None
) -> None:
    out = post(live, path, body)
    assert out.status_code == status, out.text
    error = out.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_messages_say_what_is_wrong(live: LiveServer) -> None:
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    out = post(live, "/tokenize", {"messages": [{"role": "user", "content": image}]})
    assert "text-only" in out.json()["error"]["message"]
    out = post(live, "/detokenize", {"tokens": [7, 100000]})
    assert "100000" in out.json()["error"]["message"]
    out = post(live, "/tokenize", {"messages": CHAT, "continue_final_message": True})
    assert "assistant" in out.json()["error"]["message"]


def test_a_lone_surrogate_is_refused(live: LiveServer) -> None:
    out = httpx.post(
        live.base_url + "/tokenize",
        content=LONE_SURROGATE,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert out.status_code == 400
    assert "surrogate" in out.json()["error"]["message"]


@pytest.fixture(scope="module")
def locked(tiny_checkpoint: Path) -> Iterator[tuple[LiveServer, RecordingTokenizer]]:
    """A server with an API key over a scripted backend whose tokenizer records its threads."""
    backend, tokenizer = scripted_backend(tiny_checkpoint, ScriptedEngine([delta("ok", 1, "stop")]))
    config = make_config(tiny_checkpoint, api_key=KEY)
    with serve_in_thread(config, loader=lambda: backend) as server:
        yield server, tokenizer


GUARDED = [
    ("/tokenize", {"prompt": TEXT}),
    ("/tokenize", {"messages": CHAT}),
    ("/detokenize", {"tokens": [5, 6]}),
    ("/v1/responses", {"input": TEXT}),
]


@pytest.mark.parametrize(("path", "body"), GUARDED)
def test_the_api_key_guards_them(locked, path: str, body: dict) -> None:
    server, _ = locked
    url = server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        out = httpx.post(url, json=body, headers=headers, timeout=60)
        assert out.status_code == 401 and out.json()["error"]["code"] == "invalid_api_key"
    out = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert out.status_code == 200, out.text


def test_tokenizing_runs_off_the_event_loop(locked) -> None:
    server, tokenizer = locked
    tokenizer.threads.clear()
    for path, body in GUARDED:
        headers = {"Authorization": f"Bearer {KEY}"}
        out = httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)
        assert out.status_code == 200
    assert len(tokenizer.threads) >= len(GUARDED)
    assert all(name.startswith("tokenize") for name in tokenizer.threads), tokenizer.threads
