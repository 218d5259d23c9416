"""Rendering chat messages through a Jinja chat template.

Owns: turning OpenAI-style messages into the prompt text a model was trained on,
and turning every way that can fail into a `ChatTemplateError` a user can act on.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from tokenization.errors import ChatTemplateError

_RENDER_ERRORS = (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError)


def _text_of(content: Any, index: int) -> Any:
    """Message content as a template expects it: text parts joined like vLLM does."""
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"messages[{index}].content: only text parts are supported (the model is "
                f"text-only), got {kind!r}"
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check the shape every template relies on and flatten text-part lists to strings."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    normalized: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object with a role")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role must be a non-empty string")
        item = dict(message)
        if "content" in item:
            item["content"] = _text_of(item["content"], index)
        normalized.append(item)
    return normalized


def render(
    hf: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for `messages`; `template` None means the checkpoint's own template.

    With `continue_final_message` the text ends where the last (assistant) message's
    content ends, without its end-of-turn, so the model goes on with that message.
    """
    if template is None and not getattr(hf, "chat_template", None):
        raise ChatTemplateError(
            "this model has no chat template; use the completions API or start the server "
            "with a chat template file"
        )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true"
        )
    normalized = normalize_messages(messages)
    tag = _continue_tag(normalized) if continue_final_message else None
    try:
        text = hf.apply_chat_template(
            normalized,
            tools=list(tools) if tools is not None else None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(template_kwargs or {}),
        )
    except _RENDER_ERRORS as exc:
        raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text if tag is None else _cut_at(text, tag)


def _continue_tag(messages: list[dict[str, Any]]) -> str:
    """Mark the end of the final message's content with a tag no input can contain.

    transformers' own way: render with the tag appended, then cut the text at the tag.
    The tag ends in a space, so a template that trims the content shows as a lost space.
    """
    last = messages[-1]
    if last.get("role") != "assistant":
        raise ChatTemplateError(
            "continue_final_message needs the last message to be an assistant message, "
            f"got role {last.get('role')!r}"
        )
    content = last.get("content")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message needs the last message to have content")
    tag = f"CONTINUE_FINAL_MESSAGE_{uuid.uuid4().hex} "
    last["content"] = content + tag
    return tag


def _cut_at(text: str, tag: str) -> str:
    at = text.rfind(tag.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the last message's "
            "content as given, so it cannot be continued"
        )
    if text.startswith(tag, at):
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content, so trim it too
