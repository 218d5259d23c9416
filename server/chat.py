"""POST /v1/chat/completions: messages through the checkpoint's chat template.

A streamed choice starts with a chunk whose delta carries role "assistant";
logprobs follow OpenAI's chat shape: content[] of token, logprob, bytes and
top_logprobs. The prompt ends with the template's generation prompt unless
add_generation_prompt is false, or with the last assistant message left open for the
model to continue (vLLM's continue_final_message). With `tools` the template renders
them, and each choice's reply is read for tool calls (server.tools); tool_choice
"required" or a named function holds the reply to its schema while decoding, as
response_format and structured_outputs do (server.structured; the tool's constraint
wins over theirs, as in vLLM). vLLM's extras: `stop_reason` in each choice, the
response's `prompt_logprobs`, and with `return_token_ids` the response's (a stream's
first chunk's) `prompt_token_ids` and each choice's (chunk's) `token_ids`. One shaper
serves /v1/chat/completions/batch too: choice i is conversation i there. vLLM's
`echo` starts the reply with the last message's text when that is an assistant's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.types import TokenLogprobs
from server.backend import ModelLimits, TokenizerClient
from server.beam_plan import beam_settings
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.generation import PromptDelta
from server.params import (
    GenerationPlan,
    PromptInput,
    build_requests,
    check_common,
    check_samples,
    finite,
    note_ignored,
    prompt_logprobs,
    sampling_params,
    stop_strings,
    truncate,
    with_extensions,
)
from server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    TokenizeRequest,
)
from server.shaping import ResponseShaper
from server.structured import compile_constraint, requested
from server.tools import ToolCallReader, ToolPlan, plan_tools, template_tool_calls


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
    """Messages as the chat template reads them: role, text content, name, and an
    assistant's tool calls or a tool message's tool_call_id, as vLLM passes them."""
    try:
        return [_template_message(m, f"{param}[{i}]") for i, m in enumerate(messages)]
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from exc


def _template_message(message: ChatMessage, where: str) -> dict[str, Any]:
    item: dict[str, Any] = {"role": message.role, "content": message.text(f"{where}.content")}
    if message.name is not None:
        item["name"] = message.name
    if message.role == "assistant" and message.tool_calls is not None:
        item["tool_calls"] = template_tool_calls(message.tool_calls, f"{where}.tool_calls")
    if message.role == "tool" and message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    return item


def render_messages(
    messages: list[dict],
    tokenizer: TokenizerClient,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    param: str = "messages",
) -> tuple[int, ...]:
    """Token ids of a conversation rendered with the chat template; a 400 when it cannot be."""
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
            tools=tools,
            template_kwargs=template_kwargs,
        )
    except ValueError as exc:
        raise bad_request(f"{param} could not be rendered: {exc}", param=param) from exc
    return tuple(ids)


def render_prompt(
    request: ChatCompletionRequest, tokenizer: TokenizerClient, tools: ToolPlan | None
) -> PromptInput:
    """The conversation (and its tools) as prompt token ids, rendered with the chat template."""
    add_generation_prompt, continue_final_message = template_flags(request)
    ids = render_messages(
        template_messages(request.messages),
        tokenizer,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=list(tools.tools) if tools is not None and tools.tools else None,
    )
    if not ids:
        raise bad_request("messages rendered to an empty prompt", param="messages")
    return PromptInput(ids, echo_text(request))


def echo_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the text the reply starts with, the last message's when it has
    the reply's role (assistant: a message continue_final_message goes on with)."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return ""
    return last.text("messages[-1].content")


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
    top_prompt = prompt_logprobs(request)
    check_samples(1, request.n, config)
    tools = plan_tools(request, config)
    asked = requested(request, tools.output_schema if tools is not None else None)
    beam = beam_settings(request, max_tokens, constrained=asked is not None)
    constraint = compile_constraint(asked, tokenizer, limits)
    sampling = sampling_params(request, top_n, max_tokens, limits, constraint)
    rendered = render_prompt(request, tokenizer, tools)
    prompt = PromptInput(truncate(rendered.ids, request, limits), rendered.text)
    requests = build_requests(
        base_id,
        [prompt],
        request,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop_strings(request, config),
        prompt_logprobs=top_prompt,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="messages",
    )
    return with_extensions(
        GenerationPlan(
            requests=requests,
            prompts=(prompt,),
            n=request.n,
            stream=request.stream,
            include_usage=False,
            echo=bool(rendered.text),
            logprobs=top_n,
            tools=tools,
            prompt_logprobs=top_prompt,
            beam=beam,
        ),
        request,
    )


def plan_batch_chat(
    base_id: str,
    request: BatchChatCompletionRequest,
    tokenizer: TokenizerClient,
    config: ServerConfig,
    limits: ModelLimits,
) -> GenerationPlan:
    """vLLM's /v1/chat/completions/batch: each conversation planned as its own chat request
    (the batch's other fields shared), run as one generation; what vLLM refuses there
    (streaming, n > 1, tools) is a 400 naming it."""
    note_ignored(request)
    if request.stream:
        raise bad_request("stream is not supported on /v1/chat/completions/batch", param="stream")
    if request.n != 1:
        raise bad_request(
            "Batch chat completions do not support `n > 1`. Please set `n` to 1.", param="n"
        )
    if request.tools or request.tool_choice not in (None, "none"):
        param = "tools" if request.tools else "tool_choice"
        raise bad_request(f"{param} is not supported on /v1/chat/completions/batch", param=param)
    count = len(request.messages)
    if count > config.max_prompts:
        raise bad_request(
            f"at most {config.max_prompts} conversations per request (max_prompts), got {count}",
            param="messages",
        )
    check_samples(count, 1, config)
    plans = []
    for i in range(count):
        try:
            one = request.conversation(i)
            plans.append(plan_chat(f"{base_id}-{i}", one, tokenizer, config, limits))
        except APIError as exc:
            if exc.param != "messages":
                raise
            message = f"messages[{i}]: {exc.message}"  # name the conversation at fault
            raise APIError(exc.status, message, param=exc.param, code=exc.code) from exc
    return replace(
        plans[0],
        requests=tuple(r for plan in plans for r in plan.requests),
        prompts=tuple(p for plan in plans for p in plan.prompts),
    )


def _entry(
    tokenizer: TokenizerClient, name: Callable[[int], str], token_id: int, logprob: float
) -> dict[str, Any]:
    return {
        "token": name(token_id),
        "logprob": finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(
    tokenizer: TokenizerClient,
    token_ids: tuple[int, ...],
    lps: tuple[TokenLogprobs, ...],
    plan: GenerationPlan,
    name: Callable[[int], str] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI's logprobs content, each position's alternatives as `plan` lists them;
    `name` gives a token's `token` (default: its text)."""
    name = name or tokenizer.token_text
    content = []
    for token_id, lp in zip(token_ids, lps, strict=True):
        entry = _entry(tokenizer, name, token_id, lp.logprob)
        top = plan.alternatives(lp)
        entry["top_logprobs"] = [_entry(tokenizer, name, t, v) for t, v in top]
        content.append(entry)
    return content


@dataclass
class ChatChoice:
    index: int
    prompt_index: int = 0
    text: str = ""
    finish_reason: str | None = None  # the engine's
    stop_reason: str | int | None = None
    logprobs: list[dict[str, Any]] | None = None
    tools: ToolCallReader | None = None  # when the reply is read for tool calls
    token_ids: list[int] = field(default_factory=list)  # generated (return_token_ids)


class ChatShaper(ResponseShaper):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, plan: GenerationPlan, tokenizer: TokenizerClient, model: str, response_id: str
    ):
        self._prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
        super().__init__(plan, tokenizer, model, response_id)

    def new_states(self, plan: GenerationPlan) -> dict[int, ChatChoice]:
        """Choice index = prompt_index * n + sample index (one prompt but in a batch)."""
        tools = plan.tools if plan.tools is not None and plan.tools.reads_calls else None
        return {
            p * plan.n + k: ChatChoice(
                index=p * plan.n + k,
                prompt_index=p,
                tools=ToolCallReader(tools) if tools else None,
            )
            for p in range(len(plan.prompts))
            for k in range(plan.n)
        }

    def opening(self) -> list[dict[str, Any]]:
        """A first chunk per choice whose delta carries the role, as OpenAI streams it (with
        content null when the reply may be tool calls, whose replies have none); the very
        first carries vLLM's prompt_token_ids when asked."""
        reads_calls = any(choice.tools is not None for choice in self.states.values())
        chunks: list[dict[str, Any]] = []
        for choice in self.states.values():
            chunk = self.chunk(
                [
                    {
                        "index": choice.index,
                        "delta": {"role": "assistant", "content": None if reads_calls else ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            if self.plan.return_token_ids and not chunks:
                chunk["prompt_token_ids"] = list(self.plan.prompts[0].ids)
            if self.plan.continuous_usage:
                chunk["usage"] = self.prompt_usage(choice.prompt_index, 0)
            chunks.append(chunk)
        for choice in self.states.values():  # chat echo: the echoed text, then the tokens
            echoed = self._echoed(choice)
            if echoed:
                entry = {"index": choice.index, "delta": {"content": echoed}}
                chunk = self.chunk([entry | {"logprobs": None, "finish_reason": None}])
                if self.plan.continuous_usage:
                    chunk["usage"] = self.prompt_usage(choice.prompt_index, 0)
                chunks.append(chunk)
        return chunks

    def _echoed(self, choice: ChatChoice) -> str:
        """What the reply starts with (vLLM's chat echo; never before tool calls)."""
        if not self.plan.echo or choice.tools is not None:
            return ""
        return self.plan.prompts[choice.prompt_index].text

    def fold(self, item: PromptDelta) -> dict[str, Any] | None:
        delta = item.delta
        choice = self.states[item.prompt_index * self.plan.n + delta.index]
        if self._prompt_logprobs is None and delta.prompt_logprobs is not None:
            self._prompt_logprobs = self.prompt_logprobs(delta.prompt_logprobs)
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        new_logprobs = None
        if self.plan.logprobs is not None and delta.logprobs is not None:
            new_logprobs = chat_logprobs(
                self.tokenizer, delta.token_ids, delta.logprobs, self.plan, self.token_text
            )
            choice.logprobs = (choice.logprobs or []) + new_logprobs
        elif self.plan.logprobs is not None and choice.logprobs is None:
            choice.logprobs = []
        finish = delta.finish_reason
        if finish is not None:
            choice.finish_reason = finish
            choice.stop_reason = delta.stop_reason
        if choice.tools is not None:
            message, finish = choice.tools.step(choice.text, finish)
        else:
            message = {"content": delta.text} if delta.text or finish is None else {}
        with_ids = self.plan.return_token_ids
        news = message.get("content") or message.get("tool_calls") or new_logprobs
        if not news and finish is None and not (with_ids and delta.token_ids):
            return None
        entry: dict[str, Any] = {
            "index": choice.index,
            "delta": message,
            "logprobs": {"content": new_logprobs} if new_logprobs is not None else None,
            "finish_reason": finish,
        }
        if finish is not None:
            entry["stop_reason"] = choice.stop_reason
        if with_ids:
            entry["token_ids"] = list(delta.token_ids)
        return self.chunk([entry])

    def choices(self) -> list[dict[str, Any]]:
        return [self._choice(c) for c in self.states.values()]

    def _choice(self, choice: ChatChoice) -> dict[str, Any]:
        if choice.tools is not None:
            message, finish = choice.tools.reply(choice.text, choice.finish_reason)
        else:
            message = {"role": "assistant", "content": self._echoed(choice) + choice.text}
            finish = choice.finish_reason
        return {
            "index": choice.index,
            "message": message,
            "logprobs": {"content": choice.logprobs} if choice.logprobs is not None else None,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
            "token_ids": choice.token_ids if self.plan.return_token_ids else None,
        }

    def response(self, completion_tokens: int) -> dict[str, Any]:
        """The body, with vLLM's prompt_logprobs and prompt_token_ids (null unless asked;
        one conversation's: a batch's body has neither)."""
        body = super().response(completion_tokens)
        if len(self.plan.prompts) == 1:
            body["prompt_logprobs"] = self._prompt_logprobs
            ids = list(self.plan.prompts[0].ids) if self.plan.return_token_ids else None
            body["prompt_token_ids"] = ids
        return body
