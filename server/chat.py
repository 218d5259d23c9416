"""POST /v1/chat/completions: messages through the checkpoint's chat template.

A streamed choice starts with a chunk whose delta carries role "assistant";
logprobs follow OpenAI's chat shape: content[] of token, logprob, bytes and
top_logprobs. The prompt ends with the template's generation prompt unless
add_generation_prompt is false, or with the last assistant message left open for the
model to continue (vLLM's continue_final_message).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.types import TokenLogprobs
from server.backend import ModelLimits, TokenizerClient
from server.config import ServerConfig
from server.errors import bad_request
from server.generation import PromptDelta
from server.params import (
    GenerationPlan,
    PromptInput,
    build_requests,
    check_common,
    check_samples,
    finite,
    sampling_params,
    stop_strings,
)
from server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from server.shaping import ResponseShaper


def template_flags(request: ChatCompletionRequest | TokenizeRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as asked; both true is a 400 (vLLM).

    continue_final_message alone turns the generation prompt off: add_generation_prompt's
    default of true is not a request for both.
    """
    if not request.continue_final_message:
        return request.add_generation_prompt, False
    if request.add_generation_prompt and "add_generation_prompt" in request.model_fields_set:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
            param="continue_final_message",
        )
    return False, True


def template_messages(messages: Sequence[ChatMessage], param: str = "messages") -> list[dict]:
    """Messages as the chat template reads them: role and text content."""
    try:
        return [
            {"role": m.role, "content": m.text(f"{param}[{i}].content")}
            for i, m in enumerate(messages)
        ]
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from exc


def render_messages(
    messages: list[dict],
    tokenizer: TokenizerClient,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    param: str = "messages",
) -> tuple[int, ...]:
    """Token ids of a conversation rendered with the chat template; a 400 when it cannot be."""
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
        )
    except ValueError as exc:
        raise bad_request(f"{param} could not be rendered: {exc}", param=param) from exc
    return tuple(ids)


def render_prompt(request: ChatCompletionRequest, tokenizer: TokenizerClient) -> PromptInput:
    """The conversation as prompt token ids, rendered with the chat template."""
    add_generation_prompt, continue_final_message = template_flags(request)
    ids = render_messages(
        template_messages(request.messages),
        tokenizer,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    if not ids:
        raise bad_request("messages rendered to an empty prompt", param="messages")
    return PromptInput(ids, "")


def plan_chat(
    base_id: str,
    request: ChatCompletionRequest,
    tokenizer: TokenizerClient,
    config: ServerConfig,
    limits: ModelLimits,
) -> GenerationPlan:
    check_common(request, config, config.model_name)
    unsupported = request.chat_unsupported()
    if unsupported is not None:
        raise bad_request(unsupported[1], param=unsupported[0], code="unsupported")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    if max_tokens == 0:
        raise bad_request(f"{param} must be >= 1", param=param)
    top_n = (request.top_logprobs or 0) if request.logprobs else None
    check_samples(1, request.n, config)
    sampling = sampling_params(request, top_n, max_tokens, limits)
    prompt = render_prompt(request, tokenizer)
    requests = build_requests(
        base_id,
        [prompt],
        request,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop_strings(request, config),
        prompt_logprobs=False,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="messages",
    )
    return GenerationPlan(
        requests=requests,
        prompts=(prompt,),
        n=request.n,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=top_n,
    )


def _entry(tokenizer: TokenizerClient, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tokenizer.token_text(token_id),
        "logprob": finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(
    tokenizer: TokenizerClient,
    token_ids: tuple[int, ...],
    lps: tuple[TokenLogprobs, ...],
    top_n: int,
) -> list[dict[str, Any]]:
    content = []
    for token_id, lp in zip(token_ids, lps, strict=True):
        entry = _entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top[:top_n]]
        content.append(entry)
    return content


@dataclass
class ChatChoice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None


class ChatShaper(ResponseShaper):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def new_states(self, plan: GenerationPlan) -> dict[int, ChatChoice]:
        return {k: ChatChoice(index=k) for k in range(plan.n)}

    def opening(self) -> list[dict[str, Any]]:
        """A first chunk per choice whose delta carries the role, as OpenAI streams it."""
        return [
            self.chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.plan.n)
        ]

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        delta = item.delta
        choice = self.states[delta.index]
        choice.text += delta.text
        new_logprobs = None
        if self.plan.logprobs is not None and delta.logprobs is not None:
            new_logprobs = chat_logprobs(
                self.tokenizer, delta.token_ids, delta.logprobs, self.plan.logprobs
            )
            choice.logprobs = (choice.logprobs or []) + new_logprobs
        elif self.plan.logprobs is not None and choice.logprobs is None:
            choice.logprobs = []
        finish = delta.finish_reason
        if finish is not None:
            choice.finish_reason = finish
        if not (delta.text or finish is not None or new_logprobs):
            return None
        entry = {
            "index": choice.index,
            "delta": {"content": delta.text} if delta.text or finish is None else {},
            "logprobs": {"content": new_logprobs} if new_logprobs is not None else None,
            "finish_reason": finish,
        }
        return self.chunk([entry])

    def choices(self) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in self.states.values()
        ]
