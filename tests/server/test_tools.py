"""Tool calling on /v1/chat/completions through real servers and the official openai SDK.

A scripted orchestrator says exactly what the "model" generates, so the parsed calls
are known (the tokenizer and a tool-aware chat template are real: the prompt the
engine would get is checked token for token). On the real tiny model, a named
tool_choice's arguments are exactly the text the model generates, whole or streamed;
required and named calls of functions whose parameters leave objects open still close
and end well within the budget (a random model would otherwise write keys until
max_tokens), on chat and on the Responses API; and a named call cut by the budget is no
call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.scripted import (
    TOOL_TEMPLATE,
    ScriptedEngine,
    delta,
    scripted_backend,
)
from tokenization import Tokenizer

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time"}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# the reply cut inside the opening tag, as tokens may cut it
CUT = len('<tool_call>\n{"name": "get_')
REPLY = ["Let me ", "check.\n<tool", CALL[len("<tool") : CUT], CALL[CUT:]]


class Scripted:
    def __init__(self, server: LiveServer, orchestrator: ScriptedEngine, tokenizer: Tokenizer):
        self.server, self.orchestrator, self.tokenizer = server, orchestrator, tokenizer
        self.client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)

    def say(self, *pieces: str) -> None:
        """What the model generates for every request from now on, delta by delta."""
        *body, last = pieces
        self.orchestrator.script = [
            *(delta(text, i + 1) for i, text in enumerate(body)),
            delta(last, len(pieces), "stop"),
        ]

    def prompt(self) -> str:
        """The last submitted prompt, as text."""
        ids = self.orchestrator.submitted[-1].prompt_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint: Path) -> Iterator[Scripted]:
    orchestrator = ScriptedEngine()
    backend, tokenizer = scripted_backend(
        tiny_checkpoint, orchestrator, chat_template=TOOL_TEMPLATE, max_model_len=1024
    )
    config = make_config(tiny_checkpoint, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(config, loader=lambda: backend) as server:
        yield Scripted(server, orchestrator, tokenizer)


@pytest.fixture(scope="module")
def no_parser(tiny_checkpoint: Path) -> Iterator[Scripted]:
    orchestrator = ScriptedEngine()
    backend, tokenizer = scripted_backend(
        tiny_checkpoint, orchestrator, chat_template=TOOL_TEMPLATE, max_model_len=1024
    )
    with serve_in_thread(make_config(tiny_checkpoint), loader=lambda: backend) as server:
        yield Scripted(server, orchestrator, tokenizer)


def calls_of(message: object) -> list[tuple[str, dict]]:
    return [
        (c.function.name, json.loads(c.function.arguments))
        for c in (getattr(message, "tool_calls", None) or [])
    ]


# --- prompts: tools and tool conversations reach the template --------------------------------


def test_tools_reach_the_template(scripted: Scripted) -> None:
    scripted.say("ok")
    scripted.client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    prompt = scripted.prompt()
    assert prompt.startswith("<s><|system|>\nTools: get_weather" + json.dumps(PARAMETERS))
    assert " get_time" in prompt and prompt.endswith(
        "<|user|>\nWeather in Paris?</s>\n<|assistant|>\n"
    )
    # /tokenize renders the same prompt when given the same tools
    counted = httpx.post(
        scripted.server.base_url + "/tokenize",
        json={"messages": ASK, "tools": TOOLS},
        timeout=30,
    ).json()
    assert counted["tokens"] == list(scripted.orchestrator.submitted[-1].prompt_ids)
    scripted.client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert "Tools: get_weather" in scripted.prompt()  # "none" still shows them (vLLM)


def test_tool_calls_and_tool_messages_render(scripted: Scripted) -> None:
    scripted.say("It is 18C in Paris.")
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]  # fmt: skip
    out = scripted.client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS)
    assert out.choices[0].message.content == "It is 18C in Paris."
    assert out.choices[0].message.tool_calls is None
    assert scripted.prompt().endswith(
        '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call></s>\n<|tool|>\n[call_1] 18C</s>\n<|assistant|>\n"
    )  # the arguments reach the template as an object, not as JSON text


# --- replies: calls parsed, whole and streamed -------------------------------------------


def test_auto_parses_the_reply_into_tool_calls(scripted: Scripted) -> None:
    scripted.say(*REPLY)
    out = scripted.client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")


def test_stream_adds_up_to_the_same_reply(scripted: Scripted) -> None:
    scripted.say(
        *REPLY, "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris"', "")
    )
    whole = scripted.client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    chunks = list(
        scripted.client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, stream=True
        )
    )
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert contents == ["Let me ", "check.\n", "\n"]  # "<tool" was held; "\n" sat between calls
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    with scripted.client.chat.completions.stream(
        model=MODEL_NAME, messages=ASK, tools=TOOLS
    ) as stream:
        streamed = stream.get_final_completion()
    for out in (whole, streamed):
        assert out.choices[0].finish_reason == "tool_calls"
        assert out.choices[0].message.content == "Let me check.\n\n"
        assert calls_of(out.choices[0].message) == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})
        ]  # fmt: skip
        ids = [c.id for c in out.choices[0].message.tool_calls or []]
        assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)


@pytest.mark.parametrize(
    "reply",
    ["Just words.", '<tool_call>{"name": "get_weather", "arguments": </tool_call>'],
    ids=["text", "malformed call"],
)
def test_text_stays_content(scripted: Scripted, reply: str) -> None:
    scripted.say(reply[:9], reply[9:])
    out = scripted.client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    assert out.choices[0].message.content == reply and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.tool_calls is None
    with scripted.client.chat.completions.stream(
        model=MODEL_NAME, messages=ASK, tools=TOOLS
    ) as stream:
        assert stream.get_final_completion().choices[0].message.content == reply


def test_required_reads_a_list_of_calls(scripted: Scripted) -> None:
    scripted.say('[{"name": "get_time", "parameters": {}}, ', '{"name": "get_weather", '
                 '"parameters": {"city": "Oslo"}}]')  # fmt: skip
    for parallel in (True, False):
        out = scripted.client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel,
        )  # fmt: skip
        expected = [("get_time", {}), ("get_weather", {"city": "Oslo"})]
        assert calls_of(out.choices[0].message) == (expected if parallel else expected[:1])
        assert out.choices[0].finish_reason == "tool_calls"


def test_named_function_reply_is_its_arguments(scripted: Scripted) -> None:
    scripted.say('{"city": ', '"Rome"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = scripted.client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=named
    )
    message = out.choices[0].message
    assert message.content is None and out.choices[0].finish_reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("get_weather", '{"city": "Rome"}')
    ]


# --- what is refused, before any stream starts ---------------------------------------------

NAMED_NOPE = {"type": "function", "function": {"name": "get_stock_price"}}
BAD = [
    ("undefined function", {"tools": TOOLS, "tool_choice": NAMED_NOPE}, "tool_choice",
     "get_stock_price"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ("unknown tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools", None),
    ("arguments not JSON", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not JSON"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("body", "param", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400s(
    scripted: Scripted, stream: bool, body: dict, param: str, says: str | None
) -> None:
    submitted = len(scripted.orchestrator.submitted)
    out = httpx.post(
        scripted.server.v1 + "/chat/completions",
        json={"messages": ASK, "stream": stream, **body},
        timeout=30,
    )
    assert out.status_code == 400 and out.headers["content-type"].startswith("application/json")
    error = out.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says is None or says in error["message"]
    assert len(scripted.orchestrator.submitted) == submitted  # nothing reached the engine


def test_sdk_raises_for_an_undefined_function(scripted: Scripted) -> None:
    with pytest.raises(openai.BadRequestError, match="get_stock_price"):
        scripted.client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED_NOPE
        )


def test_auto_needs_the_parser_flags(no_parser: Scripted) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        no_parser.client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    assert "--enable-auto-tool-choice and --tool-call-parser" in error.value.body["message"]
    no_parser.say(CALL)  # without a parser, none and named still serve
    out = no_parser.client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"


# --- the real tiny model -------------------------------------------------------------------


def test_named_arguments_are_the_generated_text(live: LiveServer) -> None:
    """The tiny checkpoint's template ignores tools, so the prompt is the plain chat's; the
    named function's arguments are the generated text, held to its parameters while
    decoding (tests/server/test_structured.py checks they validate)."""
    client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)
    common = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**common)  # type: ignore[call-overload]
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(**common, tools=TOOLS, tool_choice=named)  # type: ignore[call-overload]
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments.startswith("{")
    assert call.function.arguments != plain.choices[0].message.content
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens
    # the SDK's own accumulation (its snapshot: get_final_completion refuses "length")
    state: ChatCompletionStreamState = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(
        **common, tools=TOOLS, tool_choice=named, stream=True
    ):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot
    [streamed_call] = streamed.choices[0].message.tool_calls or []
    assert (streamed_call.function.name, streamed_call.function.arguments) == (
        "get_time", call.function.arguments
    )  # fmt: skip
    assert streamed_call.id.startswith("chatcmpl-tool-")
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason


# Parameters that leave their objects open (no additionalProperties) and values that end:
# a random model ends these calls only if no object takes keys beyond those listed.
LIGHT = {
    "type": "object",
    "properties": {"room": {"enum": ["hall", "den"]}, "on": {"type": "boolean"}},
    "required": ["room", "on"],
}
OPEN_TOOLS = [
    {"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: {}
]
CLOSED = {  # what each function's arguments must be
    "set_light": {**LIGHT, "additionalProperties": False},
    "get_time": {"type": "object", "additionalProperties": False},
}
LIGHTS = [{"role": "user", "content": "Turn off the hall light."}]
SET_LIGHT = {"type": "function", "function": {"name": "set_light"}}
TOOL_BUDGET = 90  # within the test server's 128 with the chat prompt


def chat_reply(client: openai.OpenAI, stream: bool, **kwargs: object) -> tuple[object, str, int]:
    """(message, finish_reason, completion tokens) of one chat completion on the tiny model;
    streamed, as the SDK accumulates the chunks."""
    kwargs = {"model": MODEL_NAME, "messages": LIGHTS, "tools": OPEN_TOOLS, **kwargs}
    if not stream:
        out = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        return out.choices[0].message, out.choices[0].finish_reason, out.usage.completion_tokens
    state: ChatCompletionStreamState = ChatCompletionStreamState()
    chunks = client.chat.completions.create(  # type: ignore[call-overload]
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    for chunk in chunks:
        state.handle_chunk(chunk)
    done = state.current_completion_snapshot
    return done.choices[0].message, done.choices[0].finish_reason, done.usage.completion_tokens


@pytest.fixture(scope="module")
def tiny_client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_calls_close_and_end(tiny_client: openai.OpenAI, stream: bool) -> None:
    """Each call is exactly {"name", "parameters"} and its parameters take only the keys
    they list, so the list closes and ends the reply: "tool_calls", as vLLM reports it.
    Greedy: the list itself takes any number of calls (vLLM's schema for "required" sets no
    maxItems), and random weights sampled at temperature 1 may add calls past any budget;
    the named call below, one object, is sampled."""
    message, finish, used = chat_reply(
        tiny_client, stream, tool_choice="required", max_tokens=TOOL_BUDGET, temperature=0.0
    )
    assert finish == "tool_calls" and used < TOOL_BUDGET, message
    calls = calls_of(message)
    assert calls and message.content is None  # type: ignore[attr-defined]
    for name, arguments in calls:
        jsonschema.validate(arguments, CLOSED[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_call_closes_and_ends(tiny_client: openai.OpenAI, stream: bool) -> None:
    for seed in range(3):
        message, finish, used = chat_reply(
            tiny_client, stream, tool_choice=SET_LIGHT, max_tokens=TOOL_BUDGET, seed=seed,
            temperature=1.0,
        )  # fmt: skip
        assert finish == "stop" and used < TOOL_BUDGET, (seed, message)  # named: OpenAI's "stop"
        [(name, arguments)] = calls_of(message)
        assert name == "set_light"
        jsonschema.validate(arguments, CLOSED[name])


def test_responses_tool_calls_close_and_end(tiny_client: openai.OpenAI) -> None:
    flat = [{"type": "function", **tool["function"]} for tool in OPEN_TOOLS]
    named = {"type": "function", "name": "set_light"}
    for choice in ("required", named):
        kwargs = {"model": MODEL_NAME, "input": LIGHTS[0]["content"], "tools": flat}
        # greedy: the Responses API has no seed, and an unseeded sample of random weights
        # may run past any budget (the chat tests above sample with seeds)
        kwargs.update(tool_choice=choice, max_output_tokens=TOOL_BUDGET, temperature=0.0)
        whole = tiny_client.responses.create(**kwargs)  # type: ignore[arg-type]
        with tiny_client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_response()
        for response in (whole, streamed):
            assert response.status == "completed", response.output
            calls = [o for o in response.output if o.type == "function_call"]
            assert calls and len(calls) == len(response.output)
            for call in calls:
                assert call.name in CLOSED and (choice == "required" or call.name == "set_light")
                jsonschema.validate(json.loads(call.arguments), CLOSED[call.name])


def test_a_named_call_cut_by_the_budget_is_no_call(tiny_client: openai.OpenAI) -> None:
    """One token of arguments is not JSON: no tool_calls, finish_reason "length"; the text
    is the content, as vLLM replies when it reads no call. Streamed alike: no call delta."""
    kwargs = {"model": MODEL_NAME, "messages": LIGHTS, "tools": OPEN_TOOLS}
    kwargs.update(tool_choice=SET_LIGHT, max_completion_tokens=1)
    whole = tiny_client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and whole.usage.completion_tokens == 1
    chunks = list(tiny_client.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
    assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    # the Responses API's named call alike: a message, not a function_call
    flat = [{"type": "function", **tool["function"]} for tool in OPEN_TOOLS]
    request = {"model": MODEL_NAME, "input": LIGHTS[0]["content"], "tools": flat}
    request.update(tool_choice={"type": "function", "name": "set_light"}, max_output_tokens=1)
    response = tiny_client.responses.create(**request)  # type: ignore[arg-type]
    with tiny_client.responses.stream(**request) as stream:  # type: ignore[arg-type]
        types = {event.type for event in stream}
        streamed = stream.get_final_response()
    for out in (response, streamed):
        assert out.status == "incomplete" and [o.type for o in out.output] == ["message"]
        assert out.output_text == choice.message.content
    assert not [t for t in types if "function_call" in t]
