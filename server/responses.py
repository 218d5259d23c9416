"""POST /v1/responses: OpenAI's Responses API, stateless, one assistant message out.

`input` (a string or message items) follows `instructions` (a system message) through
the chat template like chat's messages, and runs as one `Generation`. Nothing is
stored, so `store: true` and `previous_response_id` are 400s. A stream is the named
events the openai SDK assembles (response.created ... response.completed); the
response ends "incomplete" with reason max_output_tokens when the budget ran out,
and, as vLLM does, a stream still ends with response.completed carrying that status.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.backend import ModelLimits, TokenizerClient
from server.chat import render_messages
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.generation import Generation, PromptDelta
from server.params import (
    GenerationPlan,
    PromptInput,
    build_requests,
    check_common,
    sampling_params,
)
from server.protocol import (
    ResponsesInputItem,
    ResponsesRequest,
    SamplingFields,
    parts_text,
)
from server.streaming import NamedEvents

ROLES = frozenset({"system", "developer", "user", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text"})  # output_text: an earlier reply


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` then `input` as chat-template messages; a 400 names the bad item."""
    messages = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    if not request.input:
        raise bad_request("input must not be an empty list", param="input")
    for index, item in enumerate(request.input):
        messages.append(_message(item, f"input[{index}]"))
    return messages


def _message(item: ResponsesInputItem, where: str) -> dict[str, Any]:
    if item.type != "message":
        raise bad_request(
            f"{where}: input items of type {item.type!r} are not supported (only messages)",
            param="input",
        )
    if item.role not in ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {item.role!r}",
            param="input",
        )
    if item.content is None:
        raise bad_request(f"{where}.content is required", param="input")
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    try:
        text = parts_text(item.content, f"{where}.content", TEXT_PARTS)
    except ValueError as exc:
        raise bad_request(str(exc), param="input") from exc
    return {"role": item.role, "content": text}


def plan_response(
    base_id: str,
    request: ResponsesRequest,
    tokenizer: TokenizerClient,
    config: ServerConfig,
    limits: ModelLimits,
) -> GenerationPlan:
    fields = SamplingFields(
        model=request.model,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
    )
    check_common(fields, config, config.model_name)
    unsupported = request.unsupported()
    if unsupported is not None:
        raise bad_request(unsupported[1], param=unsupported[0], code="unsupported")
    max_tokens = request.max_output_tokens
    sampling = sampling_params(fields, None, max_tokens, limits)
    ids = render_messages(input_messages(request), tokenizer, param="input")
    if not ids:
        raise bad_request("input rendered to an empty prompt", param="input")
    prompt = PromptInput(ids, "")
    requests = build_requests(
        base_id,
        [prompt],
        fields,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=(),
        prompt_logprobs=False,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="input",
    )
    return GenerationPlan(
        requests=requests, prompts=(prompt,), n=1, stream=request.stream, include_usage=False
    )


class ResponsesShaper:
    """One response object and its stream events; the `Shaper` of /v1/responses."""

    def __init__(
        self, plan: GenerationPlan, request: ResponsesRequest, model: str, response_id: str
    ):
        self.plan = plan
        self.request = request
        self.model = model
        self.id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def incomplete(self) -> bool:
        return self.finish_reason == "length"

    # --- streamed events ------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        """Events before any token: the response, then its (empty) message and text part."""
        start = self.response_object(None, status="in_progress")
        return [
            {"type": "response.created", "response": start},
            {"type": "response.in_progress", "response": start},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": self.message("", status="in_progress"),
            },
            {
                "type": "response.content_part.added",
                "item_id": self.message_id,
                "output_index": 0,
                "content_index": 0,
                "part": _text_part(""),
            },
        ]

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        """Fold a delta in; its response.output_text.delta event when it carries text."""
        delta = item.delta
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if not delta.text:
            return None
        return {
            "type": "response.output_text.delta",
            "item_id": self.message_id,
            "output_index": 0,
            "content_index": 0,
            "delta": delta.text,
            "logprobs": [],
        }

    def closing(self, completion_tokens: int) -> list[dict[str, Any]]:
        """Events after the last token: the text, part and message done, then the response."""
        status = "incomplete" if self.incomplete else "completed"
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            {"type": "response.output_text.done", **where, "text": self.text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": _text_part(self.text)},
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": self.message(self.text, status=status),
            },
            {"type": "response.completed", "response": self.response(completion_tokens)},
        ]

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The `Shaper` protocol's; usage reaches a stream inside response.completed."""
        return self.closing(completion_tokens)[-1]

    # --- the response object ------------------------------------------------------------

    def response(self, completion_tokens: int) -> dict[str, Any]:
        """The whole response object (the body, and response.completed's `response`)."""
        status = "incomplete" if self.incomplete else "completed"
        return self.response_object(completion_tokens, status=status)

    def message(self, text: str, *, status: str) -> dict[str, Any]:
        content = [_text_part(text)] if status != "in_progress" else []
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def response_object(self, completion_tokens: int | None, *, status: str) -> dict[str, Any]:
        """The response in `status`; `completion_tokens` None while it is in progress."""
        done = completion_tokens is not None
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.model,
            "output": [self.message(self.text, status=status)] if done else [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
            "tools": [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": self.usage(completion_tokens) if completion_tokens is not None else None,
            "user": request.user,
        }

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        input_tokens = sum(len(p.ids) for p in self.plan.prompts)
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + completion_tokens,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def stream_events(generation: Generation, shaper: ResponsesShaper) -> AsyncIterator[bytes]:
    """The response's named SSE events; a failure after the start is an `error` event.

    Only the framing is this endpoint's: the Generation still submits, merges,
    observes metrics, maps every failure to one APIError and closes once.
    """
    events = NamedEvents()
    try:
        for event in shaper.opening():
            yield events.encode(event)
        async for item in generation.deltas():
            piece = shaper.apply(item)
            if piece is not None:
                yield events.encode(piece)
        for event in shaper.closing(generation.completion_tokens):
            yield events.encode(event)
    except APIError as error:
        yield events.error(error)
    finally:
        await generation.close()
