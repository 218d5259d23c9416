"""Pydantic models of the OpenAI requests we accept.

Unknown fields are ignored, as OpenAI and vLLM do, and each request names them
(`RequestModel.ignored_fields`) for one warning in the log; vLLM's extras (`top_k`,
`ignore_eos`, `stop_token_ids`, `min_tokens`, `allowed_token_ids`, `prompt_logprobs`,
`return_token_ids`, `truncate_prompt_tokens`, ...) are accepted. Fields we know but do
not support are declared so that setting them is a clear 400 (see `unsupported`),
never silently ignored. Limits that depend on the server's config are checked
later, in `server.params`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from engine.types import MAX_LOGPROBS

PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
StopInput = StrictStr | list[StrictStr] | None

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed reaches the engine unchanged
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's range: [0, 2]
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2]


def _float(ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """An optional JSON number (ints allowed, bools and strings not) that must be finite."""
    return Field(default=None, allow_inf_nan=False, ge=ge, gt=gt, le=le)


class RequestModel(BaseModel):
    """A request body: fields no model declares are dropped, and named (`ignored_fields`)
    so the planner can log them once, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, RequestModel):
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(
                cls.model_fields
            )
            model._ignored = tuple(sorted(str(k) for k in data if k not in known))
        return model

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Top-level fields of the body that no field here reads."""
        return self._ignored


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage on every chunk too


class SamplingFields(RequestModel):
    """Fields shared by both endpoints.

    Types are strict, as OpenAI's are: "5" is not a number and true is not 1.
    Every number is bounded here or in `server.params` (where the bound needs
    the model), so any value accepted is one the engine can hold.
    """

    model: StrictStr | None = None
    temperature: StrictFloat | None = _float(ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = _float(gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopInput = None
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: StrictFloat | None = _float(ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | None = _float(ge=-MAX_PENALTY, le=MAX_PENALTY)
    user: StrictStr | None = None
    # vLLM extras
    top_k: StrictInt | None = Field(default=None, ge=-1)  # -1 or 0: off; <= vocab (params)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt = Field(default=0, ge=0)  # <= max_tokens (params)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    allowed_token_ids: list[StrictInt] | None = None  # non-empty, in the vocabulary (params)
    # OpenAI's: token id (a string of an int) -> bias; keys parsed in server.params, count,
    # range and ids are SamplingParams' rules
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    # structured outputs (server.structured reads and checks them): OpenAI's response_format,
    # vLLM's structured_outputs, and the guided_* fields vLLM removed, read as aliases
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's: prompt logprobs (k alternatives, <= MAX_LOGPROBS; params), token ids in the
    # choices, "token_id:N" for tokens in logprobs, and prompt truncation to N tokens
    prompt_logprobs: StrictInt | None = None
    # vLLM's: these ids' logprobs at each generated position instead of the most likely
    # ones (with logprobs set; 1 to 128 ids in the vocabulary: engine.types' rules)
    logprob_token_ids: list[StrictInt] | None = None
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # -1: the context
    truncation_side: Literal["left", "right"] | None = None  # None: left (keep the last N)
    # vLLM's beam search (server.beam_plan): n beams; length_penalty and early_stopping
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat | None = _float()  # vLLM reads it in beam search alone
    early_stopping: StrictBool = False
    priority: StrictInt = 0  # vLLM's; 0 (its default scheduling) is all there is here
    # vLLM's and transformers': prompt and output tokens' logits pulled towards 0 (1: off)
    repetition_penalty: StrictFloat | None = _float(gt=0.0)
    # known but unsupported: rejected when they would change the output
    min_p: StrictFloat | None = _float()
    kv_transfer_params: dict[str, Any] | None = None
    bad_words: list[StrictStr] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first set field we cannot honour, else None."""
        if self.min_p not in (None, 0.0):
            return "min_p", "min_p is not supported"
        if self.kv_transfer_params is not None:
            return (
                "kv_transfer_params",
                "kv_transfer_params is not supported: this server does not transfer KV "
                "between instances",
            )
        if self.bad_words:
            return "bad_words", "bad_words is not supported"
        if self.priority != 0:
            return "priority", "priority is not supported (requests are served in order)"
        return None


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value


# Part types that carry media: a 400 that says why, since every model served here reads text.
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "image_file", "input_audio", "audio_url", "video_url"}
)


def parts_text(parts: list[dict[str, Any]], where: str, text_types: frozenset[str]) -> str:
    """Text parts joined with "\\n" as vLLM joins them; ValueError names the first bad part."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{where}[{index}].type must be a string")
        if kind in text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}[{index}].text must be a string")
            texts.append(text)
        elif kind in MEDIA_PART_TYPES:
            raise ValueError(
                f"{where}[{index}] is a {kind!r} part, but this model is text-only: "
                "only text content is supported"
            )
        else:
            raise ValueError(f"{where}[{index}]: content part type {kind!r} is not supported")
    return "\n".join(texts)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    """One entry of `tools`: a function the model may call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the reply must call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None  # JSON text (OpenAI's) or the object


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages: the call this answers

    def text(self, where: str = "content") -> str:
        """The message content as text; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return parts_text(self.content, where, frozenset({"text"}))


class ChatFields(SamplingFields):
    """Chat's fields but the conversation: one request's, or each of a batch's."""

    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (server.tools)
    parallel_tool_calls: StrictBool | None = None  # false: only the first call read is kept
    functions: list[Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: extend the last (assistant) message
    echo: StrictBool = False  # vLLM's: the reply starts with the last (assistant) message's text

    def chat_unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "functions (legacy function calling) are not supported: use tools"
        return self.unsupported()


class ChatCompletionRequest(ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)


class BatchChatCompletionRequest(ChatFields):
    """vLLM's POST /v1/chat/completions/batch: `messages` is a list of conversations, each
    answered by one choice (choice i for conversation i); not streamed, n = 1, no tools."""

    messages: list[list[ChatMessage]] = Field(min_length=1)

    def conversation(self, index: int) -> ChatCompletionRequest:
        """Conversation `index` as a chat request with the batch's other fields (already
        validated, so built, not validated again; the fields set stay those sent)."""
        values = {name: getattr(self, name) for name in ChatFields.model_fields}
        return ChatCompletionRequest.model_construct(
            _fields_set=self.model_fields_set, **values, messages=self.messages[index]
        )


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: `prompt` (text) or `messages` (rendered with the chat template).

    vLLM's two request types in one model, told apart by which input is given, so an
    error names the field at fault instead of the other type's missing one.
    """

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None  # with messages: given to the chat template
    add_special_tokens: StrictBool | None = None  # None: true for prompt, false for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False  # known, not supported


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class ResponsesInputItem(BaseModel):
    """One item of a Responses `input` list: a message, or an earlier turn's function call
    and its result (checked when planned, by server.responses_input)."""

    model_config = ConfigDict(extra="ignore")

    type: StrictStr = "message"  # an "easy input message" has no type
    role: StrictStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None
    # function_call (call_id, name, arguments) and function_call_output (call_id, output)
    call_id: StrictStr | None = None
    name: StrictStr | None = None
    arguments: StrictStr | None = None
    output: StrictStr | list[dict[str, Any]] | None = None


class ResponsesTextFormat(BaseModel):
    """`text.format`: text, `{"type": "json_object"}` or `{"type": "json_schema", "name",
    "schema", "strict"}` (flat, unlike chat's response_format; server.structured reads it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: StrictStr = "text"
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def echo(self) -> dict[str, Any]:
        """The format as the response object repeats it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponsesTextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: ResponsesTextFormat | None = None


class ResponsesTool(BaseModel):
    """One entry of a Responses `tools`: only `function` tools are served (server.tools),
    flat, unlike chat's `{"type": "function", "function": {...}}`."""

    model_config = ConfigDict(extra="ignore")

    type: StrictStr
    name: StrictStr | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponsesToolChoice(BaseModel):
    """`tool_choice` naming a function: `{"type": "function", "name": ...}`."""

    model_config = ConfigDict(extra="ignore")

    type: StrictStr
    name: StrictStr | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesReasoning(BaseModel):
    """`reasoning`: effort (one of OpenAI's levels) and summary (refused when set)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: StrictStr | None = None
    generate_summary: None = None  # OpenAI's deprecated name of summary: only null


class ResponsesRequest(RequestModel):
    """OpenAI's Responses API (POST /v1/responses), with vLLM's sampling extras.

    `store` (default true) keeps the response for GET, cancel and `previous_response_id`
    (server.response_store); `background` needs it. Fields that need features not served
    (conversations, prompt templates, reasoning summaries, built-in tools) are declared so
    that asking for them is a clear 400.
    """

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: StrictStr | list[ResponsesInputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = _float(ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = _float(gt=0.0, le=1.0)
    stream: StrictBool = False
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool = True
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    text: ResponsesTextConfig | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    background: StrictBool = False
    # message.output_text.logprobs: each output token's logprob and top_logprobs of them
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # effort reaches the chat template as reasoning_effort (vLLM's); no summaries
    reasoning: ResponsesReasoning | None = None
    # vLLM's: the prompt and the reply as raw text and token ids in the response
    enable_response_messages: StrictBool = False
    # vLLM's sampling extras, as chat and completions read them (server.params)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    presence_penalty: StrictFloat | None = _float(ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | None = _float(ge=-MAX_PENALTY, le=MAX_PENALTY)
    stop: StopInput = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    repetition_penalty: StrictFloat | None = _float(gt=0.0)
    min_p: StrictFloat | None = _float()
    # known but unsupported: rejected when they would change the output
    conversation: Any = None
    prompt: Any = None
    truncation: Literal["auto", "disabled"] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first set field we cannot honour, else None."""
        if self.conversation is not None:
            return "conversation", (
                "conversation is not supported: chain responses with previous_response_id"
            )
        if self.background and not self.store:
            return "background", "background can only be used when `store` is true"
        if self.background and self.stream:
            return "stream", "background responses cannot be streamed here"
        for item in self.include or ():
            if item != LOGPROBS_INCLUDE:
                return "include", f"include {item!r} is not supported (only {LOGPROBS_INCLUDE!r})"
        if self.reasoning is not None and self.reasoning.summary is not None:
            return "reasoning", (
                "reasoning.summary is not supported: this server reads no reasoning from replies"
            )
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported"
        if self.truncation == "auto":
            return "truncation", "truncation: auto is not supported"
        if self.min_p not in (None, 0.0):
            return "min_p", "min_p is not supported"
        return None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())
