"""Tool-call parsers and the reader that streams them, exactly, without a server.

Each parser: plain text, one call, several calls, malformed JSON (text), text before a
call. The reader: whatever way an output is cut into deltas, the streamed content and
calls add up to the whole reply, and content that could start a call is never sent early;
a named reply cut short is no call. The schema tool_choice holds a reply to: one entry
per tool, each call and each object in its parameters closed to the keys it lists.
"""

from __future__ import annotations

import json

import pytest

from server.config import ServerConfig
from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.tool_parsers import (
    PARSERS,
    ParsedCall,
    ParsedOutput,
    parse_hermes,
    parse_llama3_json,
    parse_required,
)
from server.tool_schema import tool_choice_schema
from server.tools import ToolCallReader, ToolPlan, plan_tools

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "CET"}


def call(name: str, arguments: dict) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def hermes(name: str, arguments: dict, close: bool = True) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n" + ("</tool_call>" if close else "")


# --- hermes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Just text, no call.", ParsedOutput("Just text, no call.")),
        ("", ParsedOutput("")),
        (hermes("get_weather", WEATHER), ParsedOutput(None, (call("get_weather", WEATHER),))),
        (
            hermes("get_weather", WEATHER) + "\n" + hermes("get_time", TIME),
            ParsedOutput(None, (call("get_weather", WEATHER), call("get_time", TIME))),
        ),
        (
            "Let me look.\n" + hermes("get_weather", WEATHER),
            ParsedOutput("Let me look.\n", (call("get_weather", WEATHER),)),
        ),
        (  # text after the call is content too
            hermes("get_time", TIME) + " done",
            ParsedOutput(" done", (call("get_time", TIME),)),
        ),
        (  # the model ended before the closing tag
            "x " + hermes("get_time", TIME, close=False),
            ParsedOutput("x ", (call("get_time", TIME),)),
        ),
        (  # no arguments: an empty object; "parameters" is read like "arguments"
            '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "t", "parameters": '
            '{"a": 1}}</tool_call>',
            ParsedOutput(None, (call("now", {}), call("t", {"a": 1}))),
        ),
        ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None),
        ('<tool_call>{"arguments": {}}</tool_call>', None),  # no name
        ('<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', None),  # not an object
        (hermes("f", {}) + '<tool_call>{"name": </tool_call>', None),  # one bad: all text
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", None),  # too deep for json
    ],
    ids=["text", "empty", "one", "two", "text before", "text after", "unclosed",
         "no arguments", "malformed", "no name", "string arguments", "one of two malformed",
         "deep nesting"],
)  # fmt: skip
def test_hermes(text: str, expected: ParsedOutput | None) -> None:
    assert parse_hermes(text) == (expected or ParsedOutput(text))


# --- llama3_json ------------------------------------------------------------------------


def llama(name: str, arguments: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The weather is fine.", ParsedOutput("The weather is fine.")),
        (llama("get_weather", WEATHER), ParsedOutput(None, (call("get_weather", WEATHER),))),
        (
            "<|python_tag|>" + llama("get_weather", WEATHER, key="arguments"),
            ParsedOutput(None, (call("get_weather", WEATHER),)),
        ),
        (
            llama("get_weather", WEATHER) + "; " + llama("get_time", TIME),
            ParsedOutput(None, (call("get_weather", WEATHER), call("get_time", TIME))),
        ),
        (
            "Sure: " + llama("get_time", TIME),
            ParsedOutput("Sure: ", (call("get_time", TIME),)),
        ),
        (
            "Sure:<|python_tag|>" + llama("get_time", TIME) + "\n",
            ParsedOutput("Sure:", (call("get_time", TIME),)),  # trailing blanks go with the calls
        ),
        ('{"name": "get_time", "parameters": {"zone": "CET"}', None),  # unclosed
        ("I like {curly} braces", None),
        ('{"city": "Paris"}', None),  # JSON, but not a call
        (llama("f", {}) + '; {"name": ', None),  # one bad: all text
    ],
    ids=["text", "one", "python tag", "two", "text before", "text before the tag",
         "malformed", "braces in prose", "not a call", "one of two malformed"],
)  # fmt: skip
def test_llama3_json(text: str, expected: ParsedOutput | None) -> None:
    assert parse_llama3_json(text) == (expected or ParsedOutput(text))


def test_required_reads_vllm_list_form() -> None:
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "now"}])
    assert parse_required(text) == ParsedOutput(
        None, (call("get_weather", WEATHER), call("now", {}))
    )
    for other in ("[]", "{}", "[1]", "text", '[{"name": "f"}, {"x": 1}]'):
        assert parse_required(other) is None


# --- the reader: streaming adds up to the whole reply -------------------------------------

OUTPUTS = [
    "Plain text without any call at all.",
    "  leading blanks, then text",
    "Let me look.\n" + hermes("get_weather", WEATHER) + "\n" + hermes("get_time", TIME),
    hermes("get_weather", WEATHER),
    "\n\n" + hermes("get_time", TIME) + "\n",
    "a <tool_ca that never closes",
    "Before <tool_call>{not json}</tool_call> after",
    "ends with a partial tag <tool_c",
]
LLAMA_OUTPUTS = [
    llama("get_weather", WEATHER) + ";" + llama("get_time", TIME),
    "Sure: <|python_tag|>" + llama("get_time", TIME),
    "Code: {x} and more text",
    "plain words, ending in <|python",
]


def stream(reader: ToolCallReader, text: str, cuts: list[int]) -> tuple[str, list, str | None]:
    """(content, tool-call deltas, finish_reason) as the stream sends them."""
    content, calls, finish = "", [], None
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        last = i == len(bounds) - 2
        delta, finish = reader.step(text[:b], "stop" if last else None)
        if delta.get("content"):
            if not last:  # before the end, content is sent in order, as generated
                assert text[len(content) :].startswith(delta["content"])
            content += delta["content"]
        calls += delta.get("tool_calls", [])
        assert last or finish is None, (a, b)
    return content, calls, finish


def cut_ways(text: str) -> list[list[int]]:
    return [[], list(range(1, len(text))), list(range(3, len(text), 7))]


@pytest.mark.parametrize(
    ("parser", "text"),
    [("hermes", t) for t in OUTPUTS] + [("llama3_json", t) for t in LLAMA_OUTPUTS],
)
def test_streamed_deltas_add_up_to_the_reply(parser: str, text: str) -> None:
    for cuts in cut_ways(text):
        plan = ToolPlan((), "auto", parser=PARSERS[parser])
        reader = ToolCallReader(plan)
        content, calls, finish = stream(reader, text, cuts)
        message, whole_finish = reader.reply(text, "stop")
        assert (message["content"] or "") == content
        assert finish == whole_finish == ("tool_calls" if calls else "stop")
        assert [{"index": i, **c} for i, c in enumerate(message.get("tool_calls", []))] == calls


def test_text_that_may_start_a_call_is_held() -> None:
    reader = ToolCallReader(ToolPlan((), "auto", parser=PARSERS["hermes"]))
    assert reader.step("Hello <tool", None) == ({"content": "Hello "}, None)
    assert reader.step("Hello <tool_call>{", None) == ({}, None)
    reader = ToolCallReader(ToolPlan((), "auto", parser=PARSERS["hermes"]))
    assert reader.step("\n\n", None) == ({}, None)  # blanks alone may precede a call
    assert reader.step("\n\nHi", None) == ({"content": "\n\nHi"}, None)


def test_named_function_streams_its_arguments() -> None:
    reader = ToolCallReader(ToolPlan((), "named", function="get_time"))
    first, _ = reader.step('{"zone"', None)
    [head] = first["tool_calls"]
    assert head["id"].startswith("chatcmpl-tool-") and len(head["id"]) > len("chatcmpl-tool-")
    assert head["type"] == "function"
    assert head["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert reader.step('{"zone"', None) == ({}, None)
    assert reader.step('{"zone": "CET"}', "stop") == (
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "CET"}'}}]},
        "stop",  # a named function's reply keeps the engine's finish_reason
    )
    message, finish = reader.reply('{"zone": "CET"}', "stop")
    assert message["content"] is None and finish == "stop"
    assert message["tool_calls"] == [
        {"id": head["id"], "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    ]  # fmt: skip


def test_required_waits_for_the_end_and_single_call_keeps_the_first() -> None:
    text = json.dumps([{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}])
    reader = ToolCallReader(ToolPlan((), "required", single_call=True))
    assert reader.step(text[:10], None) == ({}, None)
    delta, finish = reader.step(text, "stop")
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["a"]


def test_a_named_reply_cut_short_is_no_call() -> None:
    """Not whole JSON: the text is the content (vLLM's reply when it reads no call), whole
    or streamed when the output ends in its first delta; a call a stream opened stays one."""
    plan = ToolPlan((), "named", function="get_time")
    message, finish = ToolCallReader(plan).reply('{"', "length")
    assert message == {"role": "assistant", "content": '{"'} and finish == "length"
    assert ToolCallReader(plan).step('{"', "length") == ({"content": '{"'}, "length")
    assert ToolCallReader(plan).step("", "length") == ({}, "length")
    whole, _ = ToolCallReader(plan).step("{}", "stop")  # whole JSON in one delta: a call
    assert whole["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    reader = ToolCallReader(plan)
    assert reader.step("", None) == ({}, None)  # nothing to open the call with yet
    assert reader.step('{"', None)[0]["tool_calls"][0]["function"]["arguments"] == '{"'
    delta, finish = reader.step('{"zo', "length")
    assert delta == {"tool_calls": [{"index": 0, "function": {"arguments": "zo"}}]}
    assert [
        c["function"]["arguments"] for c in reader.reply('{"zo', "length")[0]["tool_calls"]
    ] == ['{"zo']  # the stream sent it as a call; its reply says the same


# --- tool_choice against tools --------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}},
        "$defs": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_plans_follow_vllm() -> None:
    assert plan_tools(request(), AUTO) is None
    auto = plan_tools(request(tools=TOOLS), AUTO)
    assert auto is not None and auto.choice == "auto" and auto.parser is PARSERS["hermes"]
    assert auto.tools == (TOOLS[0], TOOLS[1]) and auto.output_schema is None
    none = plan_tools(request(tools=TOOLS, tool_choice="none"), ServerConfig())
    assert none is not None and not none.reads_calls and none.tools  # the template gets them
    empty = plan_tools(request(tools=[], tool_choice="required"), ServerConfig())
    assert empty is not None and empty.choice == "none"
    named = plan_tools(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}),
        ServerConfig(),
    )
    assert named is not None and named.function == "now"
    # objects are closed where every schema is (tokenization.json_schema)
    assert named.output_schema == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("fields", "config", "says"),
    [
        ({"tools": TOOLS}, ServerConfig(), "--enable-auto-tool-choice and --tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": "auto"}, ServerConfig(tool_call_parser="hermes"),
         "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, AUTO, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         AUTO, "'nope'"),
    ],
    ids=["no parser", "not enabled", "required without tools", "undefined function"],
)  # fmt: skip
def test_bad_tool_choice_is_a_400(fields: dict, config: ServerConfig, says: str) -> None:
    with pytest.raises(APIError) as error:
        plan_tools(request(**fields), config)
    assert error.value.status == 400 and error.value.param == "tool_choice"
    assert says in error.value.message


def test_required_schema_lists_each_tool_with_hoisted_defs() -> None:
    tools = request(tools=TOOLS).tools or []
    schema = tool_choice_schema(tools, "required")
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": {"type": "object",
                                           "properties": {"city": {"$ref": "#/$defs/city"}}}},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"], "additionalProperties": False},
        ]},
        "$defs": {"city": {"type": "string"}},
    }  # fmt: skip
    assert "$defs" in (tools[0].function.parameters or {})  # the request's own is untouched
    assert tool_choice_schema(tools, "auto") is None
