"""Tools on /v1/chat/completions and /v1/responses: which calls a request allows, and
reading them out.

Owns: `tool_choice` against `tools` (vLLM's rules, each failure a 400; the Responses
API's flat function tools and `{"type": "function", "name"}` read as chat's), tools and
earlier tool calls as chat templates read them, which JSON schema a reply must follow
(server.tool_schema builds it), and each choice's `ToolCallReader`, which turns the
generated text into `message.tool_calls` and, streaming, into OpenAI's tool-call deltas.

tool_choice, as vLLM serves it:
- "none": the tools still go to the template; the reply is text.
- "auto" (the default when tools are given): the reply is read with the format of
  `--tool-call-parser`; without it and `--enable-auto-tool-choice` a 400 says so.
- "required": the reply is a JSON list of `{"name", "parameters"}` (vLLM's form), or
  else whatever the configured parser finds in it.
- `{"type": "function", "function": {"name": f}}`: the whole reply is f's arguments.
Required and named are enforced while decoding: server.tool_schema gives the schema
the structured-output constraint holds the reply to (server.structured), so a named
function's arguments and each required call's parameters follow the function's
`parameters`, closed to the keys they list.

A named function's reply that is not whole JSON (cut by max_tokens or a stop string)
is no call: its text is the content, finish_reason "length" (or "stop"), as vLLM
replies when it reads no call and OpenAI sends none. Streamed, the arguments go out as
they come, as vLLM and OpenAI stream them, so only a reply cut within its first delta
(a budget of one token) can still be told apart: it streams as content, no call. Once
a call's first delta is out the stream cannot take it back; it ends with the arguments
as generated and finish_reason "length", and the reply agrees (the call stays one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.config import ServerConfig
from server.errors import bad_request
from server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    MessageToolCall,
    NamedToolChoice,
    ResponsesRequest,
    ToolChoice,
)
from server.tool_parsers import PARSERS, ParsedCall, ParsedOutput, ToolParser, parse_required
from server.tool_schema import tool_choice_schema

AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its prompt and how its reply is read."""

    tools: tuple[dict[str, Any], ...]  # as the chat template reads them
    choice: Literal["none", "auto", "required", "named"]
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # the reply format of auto (and required's fallback)
    single_call: bool = False  # parallel_tool_calls: false
    output_schema: dict[str, Any] | None = None  # what the reply must follow (enforced)

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"


def tool_dicts(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """`tools` as transformers' apply_chat_template takes them; None when there are none."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def plan_tools(request: ChatCompletionRequest, config: ServerConfig) -> ToolPlan | None:
    """The chat request's use of tools (None: it gives none); a 400 names what is wrong."""
    return plan_tool_use(request.tools, request.tool_choice, request.parallel_tool_calls, config)


def plan_response_tools(request: ResponsesRequest, config: ServerConfig) -> ToolPlan | None:
    """A Responses request's use of tools, by chat's rules once its tools are read as chat's.

    No tools and tool_choice auto (OpenAI's default) is no tools, not a 400.
    """
    if not request.tools and request.tool_choice in (None, "none", "auto"):
        return None
    return plan_tool_use(
        response_tools(request),
        response_tool_choice(request),
        request.parallel_tool_calls,
        config,
    )


def response_tools(request: ResponsesRequest) -> list[ChatTool] | None:
    """Responses function tools as chat's; any other tool type is a 400."""
    if request.tools is None:
        return None
    out = []
    for index, tool in enumerate(request.tools):
        where = f"tools[{index}]"
        if tool.type != "function":
            raise bad_request(
                f"{where}: tools of type {tool.type!r} are not supported (only function tools)",
                param="tools",
                code="unsupported",
            )
        if not tool.name:
            raise bad_request(f"{where}.name is required", param="tools")
        function = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(ChatTool(function=function))
    return out


def response_tool_choice(request: ResponsesRequest) -> ToolChoice | None:
    """`{"type": "function", "name": f}` as chat's named choice; other types are a 400."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise bad_request(
            f"tool_choice of type {choice.type!r} is not supported (only function)",
            param="tool_choice",
            code="unsupported",
        )
    if not choice.name:
        raise bad_request("tool_choice.name is required", param="tool_choice")
    return NamedToolChoice(function=FunctionName(name=choice.name))


def plan_tool_use(
    tools: Sequence[ChatTool] | None,
    choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    config: ServerConfig,
) -> ToolPlan | None:
    """The use of `tools` under `choice` (None: there are none); a 400 names what is wrong."""
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    dicts = tuple(tool_dicts(tools) or ())
    single = parallel_tool_calls is False
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"`tools` (they define: {', '.join(map(repr, names)) or 'no functions'})",
                param="tool_choice",
            )
        schema = tool_choice_schema(tools, choice)
        return ToolPlan(dicts, "named", function=choice.function.name, output_schema=schema)
    if choice is None:
        choice = "auto"
    if choice == "none" or not tools:  # "required" of no tools is "none", as OpenAI has it
        return ToolPlan(dicts, "none")
    parser = PARSERS.get(config.tool_call_parser or "")
    if choice == "required":
        schema = tool_choice_schema(tools, choice)
        if single and schema is not None:  # parallel_tool_calls: false -> exactly one call
            schema["maxItems"] = 1
        return ToolPlan(dicts, "required", parser=parser, single_call=single, output_schema=schema)
    if parser is None or not config.enable_auto_tool_choice:
        raise bad_request(f'"auto" tool choice requires {AUTO_FLAGS} to be set', "tool_choice")
    return ToolPlan(dicts, "auto", parser=parser, single_call=single)


def template_tool_calls(calls: Sequence[MessageToolCall], where: str) -> list[dict[str, Any]]:
    """Earlier tool calls as templates read them: arguments as an object, not JSON text.

    Transformers' convention, which vLLM follows; empty arguments are `{}`. ValueError
    names a call whose arguments are not a JSON object.
    """
    out = []
    for index, call in enumerate(calls):
        arguments: Any = call.function.arguments
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{where}[{index}].function.arguments is not JSON: {exc}") from exc
        elif not arguments:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{index}].function.arguments must be a JSON object")
        item: dict[str, Any] = {"type": "function"}
        item["function"] = {"name": call.function.name, "arguments": arguments}
        if call.id is not None:
            item["id"] = call.id
        out.append(item)
    return out


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallReader:
    """One choice's reply read for tool calls, whole (`reply`) or as it streams (`step`).

    Streaming, text goes out as content as soon as the parser says no call can start in
    it, and the rest waits for the end of the output; there the whole text is read once,
    as `reply` reads it, and what was held goes out, so the deltas add up to the whole
    response. Content that is only blanks so far is held too: a reply of calls alone has
    none. A named function's arguments stream as they come; a named reply that ends in
    the delta that starts it is a call only when it is whole JSON (`read`).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._sent = 0  # characters of the output streamed (content, or named arguments)
        self._text_until = 0  # the output is text up to here whatever follows
        self._ids: list[str] = []  # call ids, made once so stream and body agree
        self._named_open = False  # streamed: the named call's first delta went out

    def read(self, text: str) -> ParsedOutput:
        """The finished output as content and calls."""
        plan = self.plan
        if plan.choice == "named":
            # Arguments cut short (max_tokens, a stop string) are no call: the text is the
            # content, as vLLM replies when it reads no call. A call a stream has opened
            # stays one, so the stream's last delta and its reply agree.
            if self._named_open or _is_json(text):
                return ParsedOutput(None, (ParsedCall(plan.function or "", text),))
            return ParsedOutput(text)
        parsed = parse_required(text) if plan.choice == "required" else None
        if parsed is None:
            parsed = plan.parser.parse(text) if plan.parser is not None else ParsedOutput(text)
        if plan.single_call and len(parsed.calls) > 1:
            return ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed

    def reply(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply's message and finish_reason."""
        parsed = self.read(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [self._call(i, call) for i, call in enumerate(parsed.calls)]
        return message, self._finish(parsed, finish_reason)

    def step(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta to stream now the output is `text`; once it has ended (finish_reason
        given), everything held back, with the reply's finish_reason."""
        if self.plan.choice == "named":
            return self._named_step(text, finish_reason is not None), finish_reason
        if finish_reason is None:
            content = self._releasable(text)
            return ({"content": content} if content else {}), None
        parsed = self.read(text)
        delta: dict[str, Any] = {}
        rest = (parsed.content or "")[self._sent :]  # the content starts with what was sent
        if rest:
            delta["content"] = rest
        if parsed.calls:
            delta["tool_calls"] = [
                {"index": i, **self._call(i, call)} for i, call in enumerate(parsed.calls)
            ]
        return delta, self._finish(parsed, finish_reason)

    def _releasable(self, text: str) -> str:
        parser = self.plan.parser
        if self.plan.choice != "auto" or parser is None:
            return ""  # required: the reply is meant to be calls, so all of it waits
        self._text_until = parser.text_until(text, self._text_until)
        if self._sent == 0 and not text[: self._text_until].strip():
            return ""
        content = text[self._sent : self._text_until]
        self._sent = self._text_until
        return content

    def _named_step(self, text: str, ended: bool) -> dict[str, Any]:
        first = not self._named_open
        if first:
            if ended and not _is_json(text):  # cut short before any of it went out: no call
                return {"content": text} if text else {}
            if not text:
                return {}
            self._named_open = True
        arguments = text[self._sent :]
        self._sent = len(text)
        if not first and not arguments:
            return {}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
        if first:  # the call's first delta carries its id, type and name
            call = {"index": 0, **self._call(0, ParsedCall(self.plan.function or "", arguments))}
        return {"tool_calls": [call]}

    def _call(self, index: int, call: ParsedCall) -> dict[str, Any]:
        while len(self._ids) <= index:
            self._ids.append(new_call_id())
        return {
            "id": self._ids[index],
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _finish(self, parsed: ParsedOutput, finish_reason: str | None) -> str | None:
        """The reply's finish_reason: `tool_calls` when calls were read; a named function's
        reply keeps the engine's reason, as OpenAI and vLLM give it."""
        if parsed.calls and self.plan.choice != "named":
            return "tool_calls"
        return finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
