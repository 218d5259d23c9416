"""POST /v1/chat/completions: messages through the checkpoint's chat template.

A streamed choice starts with a chunk whose delta carries role "assistant";
logprobs follow OpenAI's chat shape: content[] of token, logprob, bytes and
top_logprobs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.request import Delta
from engine.types import TokenLogprobs
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.exchange import Exchange
from server.generation import failure_error
from server.params import (
    GenerationPlan,
    ModelLimits,
    PromptInput,
    TokenizerLike,
    build_requests,
    check_common,
    check_samples,
    finite,
    sampling_params,
    stop_strings,
)
from server.protocol import ChatCompletionRequest
from server.streaming import DONE, encode_event, error_event


def render_prompt(request: ChatCompletionRequest, tokenizer: Any) -> PromptInput:
    """The conversation as prompt token ids, rendered with the chat template."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from exc
    try:
        rendered = tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise bad_request(f"messages could not be rendered: {exc}", param="messages") from exc
    ids = tokenizer.encode(rendered) if isinstance(rendered, str) else list(rendered)
    if not ids:
        raise bad_request("messages rendered to an empty prompt", param="messages")
    return PromptInput(tuple(ids), "")


def plan_chat(
    base_id: str,
    request: ChatCompletionRequest,
    tokenizer: Any,
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


def _entry(tokenizer: TokenizerLike, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tokenizer.token_text(token_id),
        "logprob": finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(
    tokenizer: TokenizerLike, token_ids: tuple[int, ...], lps: tuple[TokenLogprobs, ...], top_n: int
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
    pieces: list[str] = field(default_factory=list)


class ChatShaper:
    def __init__(
        self, plan: GenerationPlan, tokenizer: TokenizerLike, model: str, response_id: str
    ):
        self.plan = plan
        self.tokenizer = tokenizer
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.choices = {k: ChatChoice(index=k) for k in range(plan.n)}

    def apply(self, delta: Delta) -> tuple[ChatChoice, list[dict[str, Any]] | None]:
        choice = self.choices[delta.index]
        choice.text += delta.text
        new_logprobs = None
        if self.plan.logprobs is not None and delta.logprobs is not None:
            new_logprobs = chat_logprobs(
                self.tokenizer, delta.token_ids, delta.logprobs, self.plan.logprobs
            )
            choice.logprobs = (choice.logprobs or []) + new_logprobs
        elif self.plan.logprobs is not None and choice.logprobs is None:
            choice.logprobs = []
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        return choice, new_logprobs

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = len(self.plan.prompts[0].ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.plan.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope([choice])

    def chunk(self, choice: ChatChoice, text: str, logprobs: Any, finish: str | None) -> dict:
        delta = {"content": text} if text or finish is None else {}
        entry = {
            "index": choice.index,
            "delta": delta,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": finish,
        }
        return self._envelope([entry])

    def response(self, completion_tokens: int) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in self.choices.values()
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion_tokens),
        }


async def complete(exchange: Exchange, shaper: ChatShaper) -> dict[str, Any]:
    try:
        async for item in exchange.deltas():
            shaper.apply(item.delta)
    except APIError:
        raise
    except Exception as exc:
        raise failure_error(exc) from exc
    return shaper.response(exchange.log.completion_tokens)


async def stream(exchange: Exchange, shaper: ChatShaper) -> AsyncIterator[bytes]:
    try:
        for index in range(shaper.plan.n):
            yield encode_event(shaper.role_chunk(index))
        async for item in exchange.deltas():
            choice, logprobs = shaper.apply(item.delta)
            finish = item.delta.finish_reason
            if item.delta.text or finish is not None or logprobs:
                yield encode_event(shaper.chunk(choice, item.delta.text, logprobs, finish))
        if shaper.plan.include_usage:
            body = shaper._envelope([])
            body["usage"] = shaper.usage(exchange.log.completion_tokens)
            yield encode_event(body)
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else failure_error(exc)
        yield error_event(error)
    finally:
        await exchange.close()
    yield DONE
