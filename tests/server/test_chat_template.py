"""Chat template options of /v1/chat/completions as vLLM has them, through the openai SDK.

The prompt a request was billed for (usage.prompt_tokens) and, at temperature 0, the
text it produced are compared with a completion of the exact prompt ids the
checkpoint's tokenizer renders, so a prompt that differs by one token shows.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer
from tokenization import Tokenizer

CHAT = [{"role": "user", "content": "Tell me a story"}]
PREFILL = [*CHAT, {"role": "assistant", "content": "Once upon a"}]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_checkpoint)


def chat(client: openai.OpenAI, messages: list, **extra: object) -> tuple[str, int]:
    """(text, prompt tokens) of a greedy chat completion."""
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    return out.choices[0].message.content, out.usage.prompt_tokens


def complete(client: openai.OpenAI, ids: list[int]) -> str:
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    return out.choices[0].text


def test_add_generation_prompt_false_is_honoured(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert len(ids) != len(tokenizer.apply_chat_template(CHAT))
    text, prompt_tokens = chat(client, CHAT, add_generation_prompt=False)
    assert prompt_tokens == len(ids)
    assert text == complete(client, ids)


def test_continue_final_message_continues_it(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template(
        PREFILL, add_generation_prompt=False, continue_final_message=True
    )
    tail = tokenizer.encode("Once upon a", add_special_tokens=False)
    assert ids[-len(tail) :] == tail  # the prompt ends in the message, not after its turn
    text, prompt_tokens = chat(
        client, PREFILL, continue_final_message=True, add_generation_prompt=False
    )
    assert prompt_tokens == len(ids)
    assert text == complete(client, ids)
    # add_generation_prompt left at its default: continuing alone is what was asked
    assert chat(client, PREFILL, continue_final_message=True) == (text, prompt_tokens)


def test_text_parts_are_joined_with_newlines(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me\na story"}])
    assert len(ids) != len(
        tokenizer.apply_chat_template([{"role": "user", "content": "Tell mea story"}])
    )
    text, prompt_tokens = chat(client, [{"role": "user", "content": parts}])
    assert prompt_tokens == len(ids)
    assert text == complete(client, ids)


@pytest.mark.parametrize(
    ("messages", "extra", "param", "says"),
    [
        (PREFILL, {"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message", "Cannot set both"),
        (CHAT, {"continue_final_message": True}, "messages", "assistant message"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
         {}, "messages", "text-only"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
         {}, "messages", "text-only"),
    ],
    ids=["both", "continue a user message", "image", "audio"],
)  # fmt: skip
def test_what_cannot_be_rendered_is_a_400(
    client: openai.OpenAI, messages: list, extra: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, messages, **extra)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param
    assert says in error.value.body["message"]
