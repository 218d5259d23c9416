"""POST /v1/responses: OpenAI's Responses API: a message and function calls out.

`input` (a string or items, server.responses_input) follows `instructions` through the
chat template like chat's messages, after the stored conversation of
`previous_response_id` when given (server.response_store), with the function `tools` as
chat's, and runs as one `Generation`. `text.format` (json_schema, json_object) and
tool_choice required / named constrain the output as chat's response_format and
tool_choice do (server.structured); with tools the reply is read for calls as chat's is
(server.tools), each call a `function_call` output item after the message (no message
when the reply is calls alone). `include: ["message.output_text.logprobs"]` puts each
output token's logprob (and `top_logprobs` alternatives) on the message's text part and
on the streamed text deltas that carry it; `reasoning.effort` reaches the chat template
as `reasoning_effort` (vLLM's); vLLM's `enable_response_messages` adds the prompt and the
reply as raw text and token ids. A stream is the named events the openai SDK assembles
(response.created ... response.completed): text as it comes; a named function's
arguments as they come (a named reply cut short before its first delta is no call but a
message, as chat's is); auto / required calls at the end, as chat streams them. The
response ends "incomplete" with reason max_output_tokens when the budget ran out, and,
as vLLM does, a stream still ends with response.completed carrying that status.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from server.backend import ModelLimits, TokenizerClient
from server.chat import chat_logprobs, render_messages
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.generation import Generation, PromptDelta
from server.params import (
    GenerationPlan,
    PromptInput,
    build_requests,
    check_common,
    note_ignored,
    sampling_params,
    stop_strings,
)
from server.protocol import ResponsesInputItem, ResponsesRequest, SamplingFields
from server.responses_input import input_items, input_messages
from server.streaming import NamedEvents
from server.structured import compile_constraint, requested_by_response
from server.tool_parsers import ParsedCall
from server.tools import ToolCallReader, plan_response_tools

logger = logging.getLogger(__name__)


def plan_response(
    base_id: str,
    request: ResponsesRequest,
    tokenizer: TokenizerClient,
    config: ServerConfig,
    limits: ModelLimits,
    history: tuple[ResponsesInputItem, ...] = (),
) -> GenerationPlan:
    """The request's plan; `history` is the conversation `previous_response_id` names."""
    fields = SamplingFields(
        model=request.model,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
        seed=request.seed,
        top_k=request.top_k,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=request.logit_bias,
        repetition_penalty=request.repetition_penalty,
    )
    check_common(fields, config, config.model_name)
    note_ignored(request)
    unsupported = request.unsupported()
    if unsupported is not None:
        raise bad_request(unsupported[1], param=unsupported[0], code="unsupported")
    if request.top_logprobs and not request.wants_logprobs:
        raise bad_request(
            'top_logprobs needs include: ["message.output_text.logprobs"]', param="top_logprobs"
        )
    top_n = (request.top_logprobs or 0) if request.wants_logprobs else None
    max_tokens = request.max_output_tokens
    tools = plan_response_tools(request, config)
    text_format = request.text.format if request.text is not None else None
    asked = requested_by_response(text_format, tools.output_schema if tools else None)
    constraint = compile_constraint(asked, tokenizer, limits)
    sampling = sampling_params(fields, top_n, max_tokens, limits, constraint)
    ids = render_messages(
        input_messages(request, history),
        tokenizer,
        tools=list(tools.tools) if tools is not None and tools.tools else None,
        template_kwargs=_template_kwargs(request),
        param="input",
    )
    if not ids:
        raise bad_request("input rendered to an empty prompt", param="input")
    prompt = PromptInput(ids, "")
    requests = build_requests(
        base_id,
        [prompt],
        fields,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop_strings(fields, config),
        prompt_logprobs=None,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="input",
    )
    return GenerationPlan(
        requests=requests,
        prompts=(prompt,),
        n=1,
        stream=request.stream,
        include_usage=False,
        logprobs=top_n,
        tools=tools,
    )


def _template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    """vLLM's: a reasoning effort reaches the template, and turns thinking on unless
    "none" (templates that read neither render as without them)."""
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return None
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


class ResponsesShaper:
    """One response object and its stream events; the `Shaper` of /v1/responses.

    Output items, in order: the message (unless the reply is calls alone), then one
    `function_call` per call read. The whole response and the stream's closing events
    come from the same `output`, so the two agree; call ids are made once per index.
    Logprobs stream on the text deltas when the reply is all message; when it is read for
    calls, they come whole with the message's text part at the end.
    """

    def __init__(
        self,
        plan: GenerationPlan,
        request: ResponsesRequest,
        model: str,
        response_id: str,
        tokenizer: TokenizerClient,
        *,
        stored: bool = False,
        history: tuple[ResponsesInputItem, ...] = (),
        prompt_text: str | None = None,
    ):
        self.plan = plan
        self.request = request
        self.model = model
        self.id = response_id
        self.tokenizer = tokenizer
        self.stored = stored  # kept by the server's response store
        self.history = history  # the conversation previous_response_id named
        self.prompt_text = prompt_text  # enable_response_messages: the rendered prompt
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] | None = [] if plan.logprobs is not None else None
        self._unsent_logprobs: list[dict[str, Any]] = []  # not yet on a streamed delta
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.text = ""
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt positions the engine took from its prefix cache
        tools = plan.tools
        self.reader = ToolCallReader(tools) if tools is not None and tools.reads_calls else None
        self.named = tools.function if tools is not None and tools.choice == "named" else None
        self._message_open = False  # streamed: the message's added events went out
        self._streamed = 0  # characters of the message's text streamed
        self._call_ids: list[tuple[str, str]] = []  # (item id, call_id) per call index

    @property
    def incomplete(self) -> bool:
        return self.finish_reason == "length"

    @property
    def status(self) -> str:
        return "incomplete" if self.incomplete else "completed"

    def apply(self, item: PromptDelta) -> None:
        """Fold a delta in (the whole response's path; a stream asks `events`)."""
        delta = item.delta
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if self.logprobs is not None and delta.logprobs is not None:
            entries = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, self.plan)
            self.logprobs += entries
            if self.reader is None:  # streamed with the text (else whole, at the end)
                self._unsent_logprobs += entries
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    # --- streamed events ------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        """Events before any token: the response, then the message when all of the reply
        is one (a named function's call is added with its first arguments)."""
        start = self.response_object(None, status="in_progress")
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": start},
            {"type": "response.in_progress", "response": start},
        ]
        if self.reader is None:
            events += self._open_message()
        return events

    def events(self, item: PromptDelta) -> list[dict[str, Any]]:
        """Fold a delta in; the events it streams: text, a named function's arguments, or
        the text a tool parser says no call can start in (the rest waits for `closing`)."""
        self.apply(item)
        text = item.delta.text
        if self.reader is None:
            return [self._text_delta(text)] if text else []
        if self.named is not None:
            released, _ = self.reader.step(self.text, item.delta.finish_reason)
            return self._named_events(released)
        released, _ = self.reader.step(self.text, None)
        content = released.get("content")
        return [*self._open_message(), self._text_delta(content)] if content else []

    def closing(self, completion_tokens: int) -> list[dict[str, Any]]:
        """Events after the last token: each item's rest and done events, then the response."""
        events: list[dict[str, Any]] = []
        for index, item in enumerate(self.output(self.status)):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                events += self._open_message()
                if text[self._streamed :]:
                    events.append(self._text_delta(text[self._streamed :]))
                where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
                part = item["content"][0]
                done = {"text": text, "logprobs": part["logprobs"]}
                events += [
                    {"type": "response.output_text.done", **where, **done},
                    {"type": "response.content_part.done", **where, "part": part},
                ]
            else:
                arguments = item["arguments"]
                if self.named is None:  # read at the end: added, then its arguments whole
                    added = {**item, "arguments": "", "status": "in_progress"}
                    events.append(
                        {"type": "response.output_item.added", "output_index": index, "item": added}
                    )
                    if arguments:
                        events.append(self._arguments_delta(index, arguments))
                events.append(
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item["id"],
                        "output_index": index,
                        "arguments": arguments,
                    }
                )
            done = {"type": "response.output_item.done", "output_index": index, "item": item}
            events.append(done)
        return [*events, self.usage_chunk(completion_tokens)]

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The `Shaper` protocol's; usage reaches a stream inside response.completed."""
        return {"type": "response.completed", "response": self.response(completion_tokens)}

    def _open_message(self) -> list[dict[str, Any]]:
        """The message's added events, once (the message is output item 0)."""
        if self._message_open:
            return []
        self._message_open = True
        return [
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

    def _text_delta(self, text: str) -> dict[str, Any]:
        """A text delta, with the logprobs of the tokens not yet sent (the reply is all
        message: when it is read for calls, they come with the message's done events)."""
        self._streamed += len(text)
        logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        return {
            "type": "response.output_text.delta",
            "item_id": self.message_id,
            "output_index": 0,
            "content_index": 0,
            "delta": text,
            "logprobs": logprobs,
        }

    def _named_events(self, released: dict[str, Any]) -> list[dict[str, Any]]:
        """The named call's events for what the reader released: the call added with its
        first arguments, then each delta. Content (the reply cut short before any of it
        went out, so no call) waits for `closing`, which sends it as the message."""
        events: list[dict[str, Any]] = []
        for call in released.get("tool_calls", ()):
            if "id" in call:
                added = self._call_item(0, ParsedCall(self.named or "", ""), "in_progress")
                events.append(
                    {"type": "response.output_item.added", "output_index": 0, "item": added}
                )
            if call["function"]["arguments"]:
                events.append(self._arguments_delta(0, call["function"]["arguments"]))
        return events

    def _arguments_delta(self, index: int, arguments: str) -> dict[str, Any]:
        return {
            "type": "response.function_call_arguments.delta",
            "item_id": self._ids(index)[0],
            "output_index": index,
            "delta": arguments,
        }

    # --- output items -------------------------------------------------------------------

    def output(self, status: str) -> list[dict[str, Any]]:
        """The finished output's items: the message and the calls read from it."""
        if self.reader is None:
            return [self.message(self.text, status=status)]
        parsed = self.reader.read(self.text)
        items = []
        if parsed.content is not None or not parsed.calls:
            items.append(self.message(parsed.content or "", status=status))
        items += [self._call_item(i, call, status) for i, call in enumerate(parsed.calls)]
        return items

    def _ids(self, index: int) -> tuple[str, str]:
        while len(self._call_ids) <= index:
            self._call_ids.append((f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex}"))
        return self._call_ids[index]

    def _call_item(self, index: int, call: ParsedCall, status: str) -> dict[str, Any]:
        item_id, call_id = self._ids(index)
        return {
            "id": item_id,
            "type": "function_call",
            "call_id": call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }

    # --- the response object ------------------------------------------------------------

    def response(self, completion_tokens: int) -> dict[str, Any]:
        """The whole response object (the body, and response.completed's `response`)."""
        return self.response_object(completion_tokens, status=self.status)

    def message(self, text: str, *, status: str) -> dict[str, Any]:
        content = [_text_part(text, self.logprobs or [])] if status != "in_progress" else []
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
        text_format = request.text.format if request.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": request.background,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.model,
            "output": self.output(status) if done else [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": self._effort(), "summary": None},
            "store": self.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text_format.echo() if text_format else {"type": "text"}},
            "tool_choice": _tool_choice(request),
            "tools": [tool.model_dump() for tool in request.tools or ()],
            "top_logprobs": request.top_logprobs,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": self.usage(completion_tokens) if completion_tokens is not None else None,
            "user": request.user,
        } | (self._raw_messages() if done else {})

    def _effort(self) -> str | None:
        return self.request.reasoning.effort if self.request.reasoning is not None else None

    def _raw_messages(self) -> dict[str, Any]:
        """vLLM's enable_response_messages: the prompt and the reply, text and token ids."""
        if self.prompt_text is None:
            return {}
        prompt = self.plan.prompts[0]
        return {
            "input_messages": [_raw(self.prompt_text, prompt.ids)],
            "output_messages": [_raw(self.text, self.token_ids)],
        }

    def conversation(self) -> tuple[dict[str, Any], ...]:
        """What a response continuing this one starts from: the earlier turns, this input,
        then this output (items as `input` takes them; instructions are not carried)."""
        items = [*self.history, *input_items(self.request)]
        earlier = [item.model_dump(exclude_none=True) for item in items]
        return (*earlier, *self.output(self.status))

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        input_tokens = sum(len(p.ids) for p in self.plan.prompts)
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + completion_tokens,
        }


def _tool_choice(request: ResponsesRequest) -> str | dict[str, Any]:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _raw(text: str, ids: Sequence[int]) -> dict[str, Any]:
    return {"type": "raw_message_tokens", "message": text, "tokens": list(ids)}


async def stream_events(
    generation: Generation,
    shaper: ResponsesShaper,
    finished: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[bytes]:
    """The response's named SSE events; a failure after the start is an `error` event.
    `finished` receives the whole response once it is complete (the store's).

    Only the framing is this endpoint's: the Generation still submits, merges,
    observes metrics, maps every failure to one APIError and closes once.
    """
    events = NamedEvents()
    try:
        for event in shaper.opening():
            yield events.encode(event)
        async for item in generation.deltas():
            for event in shaper.events(item):
                yield events.encode(event)
        closing = shaper.closing(generation.completion_tokens)
        if finished is not None:
            finished(closing[-1]["response"])
        for event in closing:
            yield events.encode(event)
    except APIError as error:
        yield events.error(error)
    finally:
        await generation.close()


async def run_in_background(
    generation: Generation,
    shaper: ResponsesShaper,
    update: Callable[[dict[str, Any]], None],
) -> None:
    """A background response's run: "queued" until it ends, as vLLM 0.32 keeps it (a
    client that polls while the status is "queued" gets the result), then the whole
    response, or "failed" with the error; a cancellation stops it (the store says so)."""
    try:
        async for item in generation.deltas():
            shaper.apply(item)
        update(shaper.response(generation.completion_tokens))
    except APIError as error:
        update(_failed(shaper, error.code or "server_error", error.message))
    except Exception:  # a formatting bug: the stored response still ends
        logger.exception("a background response failed")
        update(_failed(shaper, "internal_error", "internal server error"))
    finally:
        await generation.close()


def _failed(shaper: ResponsesShaper, code: str, message: str) -> dict[str, Any]:
    failed = shaper.response_object(None, status="failed")
    return failed | {"error": {"code": code, "message": message}}
