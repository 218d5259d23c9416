"""The chat template's continue_final_message (vLLM's, transformers' way) and its options.

The rendered text must end exactly where the last assistant message's content ends,
without the end-of-turn the template writes after it, whatever the content ends with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenization import ChatTemplateError, Tokenizer

# The conftest template: <|role|>content<|endoftext|> per message, BOS first.
BOS, EOT = "<|begin_of_text|>", "<|endoftext|>"
TRIMMING = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | trim }}</turn>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
USER_ONLY = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def chat(reply: str) -> list[dict]:
    return [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("reply", ["Once upon", "Once upon ", "Once\n", ""])
def test_the_text_ends_at_the_final_message(byte_level: Tokenizer, reply: str):
    text = byte_level.render_chat(
        chat(reply), add_generation_prompt=False, continue_final_message=True
    )
    assert text == f"{BOS}<|user|>Tell me{EOT}<|assistant|>{reply}"
    closed = byte_level.render_chat(chat(reply), add_generation_prompt=False)
    assert closed == text + EOT  # without it, the turn is closed


def test_ids_follow_the_text(byte_level: Tokenizer):
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    text = byte_level.render_chat(chat("Once upon"), **kwargs)
    ids = byte_level.apply_chat_template(chat("Once upon"), **kwargs)
    assert ids == byte_level.encode(text, add_special_tokens=False)
    with_bos = byte_level.apply_chat_template(chat("Once upon"), add_special_tokens=True, **kwargs)
    assert with_bos == byte_level.encode(text, add_special_tokens=True) == [2, *ids]


def test_a_template_that_trims_content_is_followed(byte_level_dir: Path):
    tok = Tokenizer.from_folder(byte_level_dir, chat_template=TRIMMING)
    text = tok.render_chat(
        chat("Once upon  "), add_generation_prompt=False, continue_final_message=True
    )
    assert text == "[user]Tell me</turn>[assistant]Once upon"


def test_content_parts_are_continued_as_joined_text(byte_level: Tokenizer):
    parts = [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon"}]
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": parts}]
    text = byte_level.render_chat(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|assistant|>Once\nupon")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": "Tell me"}], "assistant message"),
        ([{"role": "assistant"}], "content"),
    ],
)
def test_what_cannot_be_continued(byte_level: Tokenizer, messages: list[dict], match: str):
    with pytest.raises(ChatTemplateError, match=match):
        byte_level.render_chat(messages, add_generation_prompt=False, continue_final_message=True)


def test_with_a_generation_prompt_is_an_error(byte_level: Tokenizer):
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        byte_level.render_chat(chat("x"), add_generation_prompt=True, continue_final_message=True)


def test_a_template_that_drops_the_message_is_an_error(byte_level_dir: Path):
    tok = Tokenizer.from_folder(byte_level_dir, chat_template=USER_ONLY)
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        tok.render_chat(chat("Once"), add_generation_prompt=False, continue_final_message=True)


def test_image_parts_say_the_model_is_text_only(byte_level: Tokenizer):
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ChatTemplateError, match="text-only"):
        byte_level.render_chat([{"role": "user", "content": image}])
