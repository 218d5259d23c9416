"""POST /v1/responses through the official openai SDK: what Responses API users see.

On the tiny real model a response must say exactly what a chat completion of the
same conversation says at temperature 0, whole or streamed, and a `text.format` schema
or a required / named tool_choice holds the output to its schema. A scripted
orchestrator gives what the random model cannot be made to give on demand: a natural
stop, a failure after the stream has started, and replies that carry tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from frontend.request import RequestFailed
from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.scripted import TOOL_TEMPLATE, ScriptedEngine, delta, scripted_backend
from tests.server.test_structured import BUDGET, PERSON, WEATHER
from tokenization import Tokenizer

INSTRUCTIONS = "Be brief."
QUESTION = "Tell me a story"
EVENTS_BEFORE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
EVENTS_AFTER = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]

ASK = "Describe a person."
PERSON_FORMAT = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
JSON_SCHEMA = {"format": PERSON_FORMAT}
JSON_OBJECT = {"format": {"type": "json_object"}}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
# the Responses API's function tools are flat: no nested "function" as chat's
FLAT_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER,
     "strict": True},
    {"type": "function", "name": "get_time", "parameters": ZONE, "strict": False},
]  # fmt: skip
SCHEMAS = {tool["name"]: tool["parameters"] for tool in FLAT_TOOLS}
NAMED = {"type": "function", "name": "get_weather"}


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return sdk(live.base_url)


def named_events(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event, checking the `event:` + `data:` framing."""
    assert "\r" not in raw and raw.endswith("\n\n")
    out = []
    for block in raw.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        data = json.loads(lines[1][len("data: ") :])
        assert data["type"] == lines[0][len("event: ") :]
        out.append((data["type"], data))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


# ---- the real model ----------------------------------------------------------------------


def test_a_response_says_what_chat_says(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL_NAME,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.model == MODEL_NAME and whole.instructions == INSTRUCTIONS
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == chat.usage.total_tokens
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [(c.type, c.annotations) for c in message.content] == [("output_text", [])]
    if chat.choices[0].finish_reason == "length":
        assert whole.status == message.status == "incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == message.status == "completed"
        assert whole.incomplete_details is None


def test_a_stream_says_what_the_whole_says(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types[len(EVENTS_BEFORE) : -len(EVENTS_AFTER)]
    assert types == EVENTS_BEFORE + deltas + EVENTS_AFTER
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[-4].text == text and events[-3].part.text == text
    # The second asks the same prompt, so the prefix cache may serve part of it.
    cached = final.usage.input_tokens_details.cached_tokens
    assert 0 <= cached < final.usage.input_tokens
    plain = final.usage.model_copy(
        update={"input_tokens_details": whole.usage.input_tokens_details}
    )
    assert plain == whole.usage and final.status == whole.status
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_raw_events_are_named_and_numbered(live: LiveServer) -> None:
    body = {"input": QUESTION, "max_output_tokens": 4, "temperature": 0, "stream": True}
    out = httpx.post(live.v1 + "/responses", json=body, timeout=60)
    assert out.status_code == 200
    assert out.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in out.text
    events = named_events(out.text)
    assert [t for t, _ in events[:4]] == EVENTS_BEFORE
    assert [t for t, _ in events[-4:]] == EVENTS_AFTER
    completed = events[-1][1]["response"]
    assert completed["usage"]["output_tokens"] == 4
    assert completed["status"] == "incomplete"  # four tokens at most: the budget ran out
    assert completed["incomplete_details"] == {"reason": "max_output_tokens"}


def test_create_stream_yields_typed_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3, stream=True)
    )
    assert events[0].type == "response.created"
    assert isinstance(events[-1], openai.types.responses.ResponseCompletedEvent)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text


def test_message_items_render_like_chat_messages(client: openai.OpenAI) -> None:
    two_parts = [{"type": "input_text", "text": "One"}, {"type": "input_text", "text": "two"}]
    items = [
        {"role": "user", "content": two_parts},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "3"}]},
        {"type": "message", "role": "developer", "content": "Four"},
    ]
    messages = [
        {"role": "user", "content": "One\ntwo"},
        {"role": "assistant", "content": "3"},
        {"role": "developer", "content": "Four"},
    ]
    whole = client.responses.create(
        model=MODEL_NAME, input=items, max_output_tokens=5, temperature=0, store=False
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0
    )
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == chat.choices[0].message.content


# ---- a scripted orchestrator ---------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint: Path) -> Iterator[tuple[LiveServer, ScriptedEngine, Tokenizer]]:
    """A tool-aware template and the hermes parser, so auto tool_choice is served."""
    orchestrator = ScriptedEngine()
    backend, tokenizer = scripted_backend(
        tiny_checkpoint, orchestrator, chat_template=TOOL_TEMPLATE, max_model_len=1024
    )
    config = make_config(tiny_checkpoint, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(config, loader=lambda: backend) as server:
        yield server, orchestrator, tokenizer


def test_the_plan_reaches_the_engine(scripted) -> None:
    server, orchestrator, tokenizer = scripted
    orchestrator.script, orchestrator.failure = [delta("Hel", 1), delta("lo", 2, "stop")], None
    whole = sdk(server.base_url).responses.create(
        input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=9, temperature=0.5, top_p=0.75
    )
    request = orchestrator.submitted[-1]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    assert request.prompt_ids == tuple(tokenizer.apply_chat_template(messages))
    assert request.max_tokens == 9 and request.n == 1
    assert (request.sampling.temperature, request.sampling.top_p) == (0.5, 0.75)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text == "Hello" and whole.output[0].status == "completed"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(request.prompt_ids), 2)
    assert whole.temperature == 0.5 and whole.top_p == 0.75 and whole.max_output_tokens == 9


def test_a_failure_mid_stream_is_an_error_event(scripted) -> None:
    server, orchestrator, _ = scripted
    orchestrator.script, orchestrator.failure = [delta("Hel", 1)], RequestFailed("boom")
    body = {"input": QUESTION, "stream": True}
    raw = httpx.post(server.v1 + "/responses", json=body, timeout=60).text
    events = named_events(raw)
    assert [t for t, _ in events] == [*EVENTS_BEFORE, "response.output_text.delta", "error"]
    error = events[-1][1]
    assert error["message"] == "request failed: boom" and error["code"] == "engine_failure"
    assert error["error"]["message"] == error["message"]
    with pytest.raises(openai.APIError, match="boom"):  # the SDK raises at the error event
        list(sdk(server.base_url).responses.create(input=QUESTION, stream=True))
    with pytest.raises(openai.APIStatusError, match="boom") as whole:
        sdk(server.base_url).responses.create(input=QUESTION)
    assert whole.value.status_code == 503


IMAGE = [{"type": "input_image", "image_url": "data:,"}]
NAMED_NOPE = {"type": "function", "name": "get_stock_price"}
CASES = [
    ("built-in tool", {"tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ("tool without a name", {"tools": [{"type": "function"}]}, 400, "tools", "name"),
    ("undefined function", {"tools": FLAT_TOOLS, "tool_choice": NAMED_NOPE}, 400, "tool_choice",
     "get_stock_price"),
    ("tool_choice of another type", {"tools": FLAT_TOOLS, "tool_choice": {"type": "file_search"}},
     400, "tool_choice", "file_search"),
    ("unknown tool_choice", {"tools": FLAT_TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice",
     None),
    ("required without tools", {"tool_choice": "required"}, 400, "tool_choice", "`tools`"),
    ("format without schema", {"text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text", "schema"),
    ("unknown format", {"text": {"format": {"type": "yaml"}}}, 400, "text", "yaml"),
    ("invalid schema", {"text": {"format": {"type": "json_schema", "name": "x",
     "schema": {"type": "nonsense"}}}}, 400, "text", None),
    ("call without call_id", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     400, "input", "input[0].call_id"),
    ("call arguments not JSON", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
     "arguments": "{oops"}]}, 400, "input", "is not JSON"),
    ("output without call_id", {"input": [{"type": "function_call_output", "output": "x"}]}, 400,
     "input", "input[0].call_id"),
    ("unknown previous_response_id", {"previous_response_id": "resp_1"}, 404,
     "previous_response_id", "Response with id 'resp_1' not found."),
    ("conversation", {"conversation": "conv_1"}, 400, "conversation", "previous_response_id"),
    ("background without store", {"background": True, "store": False}, 400, "background",
     "`store` is true"),
    ("include of another kind", {"include": ["reasoning.encrypted_content"]}, 400, "include",
     "reasoning.encrypted_content"),
    ("top_logprobs without include", {"top_logprobs": 2}, 400, "top_logprobs", "include"),
    ("reasoning summary", {"reasoning": {"summary": "auto"}}, 400, "reasoning", "summary"),
    ("unknown effort", {"reasoning": {"effort": "extreme"}}, 400, "reasoning", "effort"),
    ("repetition_penalty not above 0", {"repetition_penalty": 0}, 400, "repetition_penalty",
     None),
    ("min_p", {"min_p": 0.1}, 400, "min_p", None),
    ("unknown model", {"model": "gpt-9"}, 404, "model", "gpt-9"),
    ("image part", {"input": [{"role": "user", "content": IMAGE}]}, 400, "input", "text-only"),
    ("unknown item type", {"input": [{"type": "reasoning", "summary": []}]}, 400, "input",
     "reasoning"),
    ("empty input list", {"input": []}, 400, "input", "empty"),
    ("input missing", {"input": None}, 400, "input", None),
    ("bad role", {"input": [{"role": "wizard", "content": "x"}]}, 400, "input", "wizard"),
    ("zero max_output_tokens", {"max_output_tokens": 0}, 400, "max_output_tokens", None),
    ("temperature above 2", {"temperature": 3}, 400, "temperature", None),
    ("background streamed", {"background": True, "stream": True}, 400, "stream",
     "cannot be streamed"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("body", "status", "param", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_what_is_not_served_is_a_clear_error(
    scripted, body: dict, status: int, param: str, says: str | None, stream: bool
) -> None:
    server, orchestrator, _ = scripted
    submitted = len(orchestrator.submitted)
    body = {"input": "x", "stream": stream, **body}
    out = httpx.post(server.v1 + "/responses", json=body, timeout=60)
    assert out.status_code == status, out.text
    assert out.headers["content-type"].startswith("application/json")  # before any stream
    error = out.json()["error"]
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status == 400 else error["type"])
    assert says is None or says in error["message"], error
    assert len(orchestrator.submitted) == submitted  # nothing reached the engine


def test_store_false_and_no_tools_are_served(scripted) -> None:
    server, orchestrator, _ = scripted
    orchestrator.script, orchestrator.failure = [delta("ok", 1, "stop")], None
    out = sdk(server.base_url).responses.create(
        input="x", store=False, tools=[], tool_choice="auto", previous_response_id=None
    )
    assert out.output_text == "ok" and out.store is False and out.tools == []


# ---- structured output and tools on the real model -------------------------------------------


def calls_of(response) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


@pytest.mark.parametrize(
    ("text", "chat_format"),
    [
        (JSON_SCHEMA, {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
         "strict": True}}),
        (JSON_OBJECT, {"type": "json_object"}),
    ],
    ids=["json_schema", "json_object"],
)  # fmt: skip
def test_text_format_constrains_like_response_format(
    client: openai.OpenAI, text: dict, chat_format: dict
) -> None:
    kwargs = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": BUDGET, "temperature": 0}
    whole = client.responses.create(text=text, **kwargs)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=BUDGET,
        temperature=0,
        response_format=chat_format,  # type: ignore[arg-type]
    )
    assert whole.output_text == chat.choices[0].message.content  # the same constraint
    assert whole.text.format.to_dict() == text["format"]  # echoed as asked
    with client.responses.stream(text=text, **kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status
    value = json.loads(whole.output_text) if whole.status == "completed" else None
    if text is JSON_SCHEMA:  # a small schema ends well within the budget
        assert whole.status == "completed", whole.output_text
        jsonschema.validate(value, PERSON)
    else:  # any object: its free keys may not close within the budget, but it is one
        assert whole.output_text.startswith("{")
        assert value is None or isinstance(value, dict)


def test_parse_with_a_pydantic_text_format(client: openai.OpenAI) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=120)
        admin: bool

    parsed = client.responses.parse(
        model=MODEL_NAME, input=ASK, max_output_tokens=BUDGET, temperature=0, text_format=Person
    )
    assert parsed.status == "completed", parsed.output_text
    assert isinstance(parsed.output_parsed, Person)
    assert Person.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Person"


def test_named_tool_choice_is_a_function_call_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": BUDGET, "temperature": 0}
    kwargs.update(tools=FLAT_TOOLS, tool_choice=NAMED)
    whole = client.responses.create(**kwargs)
    [call] = whole.output  # no message: the whole reply is the call
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert whole.tool_choice.to_dict() == NAMED
    assert [t.to_dict(exclude_none=True) for t in whole.tools] == FLAT_TOOLS
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types[3:-3]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", *deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert len(deltas) > 1 and set(deltas) == {"response.function_call_arguments.delta"}
    assert "".join(e.delta for e in events[3:-3]) == call.arguments == events[-3].arguments
    [streamed] = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert streamed.parsed_arguments == json.loads(call.arguments)  # a strict tool: parsed
    assert events[2].item.id == streamed.id == events[-2].item.id


def test_required_tool_choice_is_a_function_call(client: openai.OpenAI) -> None:
    """parallel_tool_calls false: one call (maxItems 1), which a random model ends in budget."""
    kwargs = {"model": MODEL_NAME, "input": ASK, "max_output_tokens": BUDGET, "temperature": 0}
    kwargs.update(tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    assert [o.type for o in whole.output] == ["function_call"]
    [(name, arguments)] = calls_of(whole)
    jsonschema.validate(arguments, SCHEMAS[name])
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert calls_of(final) == calls_of(whole)


def test_auto_needs_the_parser_flags(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, input=ASK, tools=FLAT_TOOLS)
    assert "--enable-auto-tool-choice and --tool-call-parser" in error.value.body["message"]
    assert error.value.body["param"] == "tool_choice"
    # none is served without them: the reply is text
    out = client.responses.create(
        model=MODEL_NAME, input=ASK, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=3
    )
    assert [o.type for o in out.output] == ["message"]


def test_the_sdk_raises_bad_request_for_a_bad_schema_streaming_too(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input=ASK, text=text)
    with (
        pytest.raises(openai.BadRequestError),
        client.responses.stream(model=MODEL_NAME, input=ASK, text=text) as stream,
    ):
        list(stream)


# ---- tools on a scripted orchestrator ----------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CUT = len('<tool_call>\n{"name": "get_')  # the reply cut inside the opening tag
REPLY = ["Let me ", "check.\n<tool", CALL[len("<tool") : CUT], CALL[CUT:]]


def say(orchestrator: ScriptedEngine, *pieces: str) -> None:
    *body, last = pieces
    orchestrator.failure = None
    orchestrator.script = [
        *(delta(text, i + 1) for i, text in enumerate(body)),
        delta(last, len(pieces), "stop"),
    ]


def test_calls_and_their_outputs_render_as_chat_tool_messages(scripted) -> None:
    server, orchestrator, tokenizer = scripted
    say(orchestrator, "18C.")
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": ""},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ]  # fmt: skip
    out = sdk(server.base_url).responses.create(input=items, tools=FLAT_TOOLS)
    assert out.output_text == "18C." and calls_of(out) == []
    prompt = orchestrator.submitted[-1].prompt_ids
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]  # fmt: skip
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in FLAT_TOOLS
    ]
    sdk(server.base_url).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=chat_tools,  # type: ignore[arg-type]
    )
    assert prompt == orchestrator.submitted[-1].prompt_ids  # rendered as chat renders it
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.startswith("<s><|system|>\nTools: get_weather" + json.dumps(WEATHER))
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in text
    assert "[call_1] 18C</s>\n<|tool|>\n[call_2] noon" in text


def test_auto_reads_calls_after_the_message_whole_and_streamed(scripted) -> None:
    server, orchestrator, _ = scripted
    say(orchestrator, *REPLY)
    client = sdk(server.base_url)
    whole = client.responses.create(input="Weather in Paris?", tools=FLAT_TOOLS)
    assert orchestrator.submitted[-1].sampling.constraint is None  # auto: free text
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "Let me check.\n"
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"}
    )  # fmt: skip
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert whole.status == call.status == "completed"
    with client.responses.stream(
        model=MODEL_NAME, input="Weather in Paris?", tools=FLAT_TOOLS
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        *EVENTS_BEFORE, "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [
        "Let me ",
        "check.\n",
    ]  # fmt: skip  ("<tool" was held back: a call might have started there)
    added, done = events[-5], events[-2]
    assert added.output_index == done.output_index == 1
    assert added.item.status == "in_progress" and added.item.arguments == ""
    assert done.item.call_id == added.item.call_id and events[-3].arguments == call.arguments
    assert final.output_text == whole.output_text and calls_of(final) == calls_of(whole)
    assert final.output[1].parsed_arguments == {"city": "Paris"}


def test_required_reads_calls_alone(scripted) -> None:
    server, orchestrator, _ = scripted
    say(orchestrator, '[{"name": "get_time", "parameters": {"zone": "UTC"}}, ',
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]')  # fmt: skip
    client = sdk(server.base_url)
    whole = client.responses.create(input="x", tools=FLAT_TOOLS, tool_choice="required")
    assert orchestrator.submitted[-1].sampling.constraint is not None  # held to the schema
    expected = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert [o.type for o in whole.output] == ["function_call", "function_call"]
    assert calls_of(whole) == expected
    assert len({o.call_id for o in whole.output}) == 2
    with client.responses.stream(
        model=MODEL_NAME, input="x", tools=FLAT_TOOLS, tool_choice="required"
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" not in types and calls_of(final) == expected
    one = client.responses.create(
        input="x", tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert calls_of(one) == expected[:1]


def test_named_streams_its_arguments_as_they_come(scripted) -> None:
    server, orchestrator, _ = scripted
    say(orchestrator, '{"city": ', '"Rome", "days": 3}')
    raw = httpx.post(
        server.v1 + "/responses",
        json={"input": "x", "tools": FLAT_TOOLS, "tool_choice": NAMED, "stream": True},
        timeout=60,
    ).text
    events = named_events(raw)
    assert [t for t, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [d["delta"] for _, d in events[3:5]] == ['{"city": ', '"Rome", "days": 3}']
    item = events[-2][1]["item"]
    assert item == {**events[2][1]["item"], "arguments": '{"city": "Rome", "days": 3}',
                    "status": "completed"}  # fmt: skip
    assert {d["item_id"] for _, d in events[3:6]} == {item["id"]}
    assert events[-1][1]["response"]["output"] == [item]


# ---- logprobs, reasoning effort, vLLM's extras ---------------------------------------------

LOGPROBS = ["message.output_text.logprobs"]


def logprob_rows(entries) -> list[tuple]:
    """(token, logprob, bytes, alternatives) of each position, from SDK objects."""
    return [
        (e.token, e.logprob, e.bytes, [(t.token, t.logprob, t.bytes) for t in e.top_logprobs])
        for e in entries
    ]


def test_logprobs_are_chats_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(include=LOGPROBS, top_logprobs=3, **kwargs)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    rows = logprob_rows(whole.output[0].content[0].logprobs)
    assert rows == logprob_rows(chat.choices[0].logprobs.content)
    assert len(rows) == whole.usage.output_tokens and all(len(r[3]) == 3 for r in rows)
    events = list(client.responses.create(include=LOGPROBS, top_logprobs=3, stream=True, **kwargs))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs for e in deltas)  # each text delta carries its tokens'
    assert logprob_rows([lp for e in deltas for lp in e.logprobs]) == rows
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert logprob_rows(done.logprobs) == rows
    assert client.responses.create(**kwargs).output[0].content[0].logprobs == []


def test_response_messages_are_the_prompt_and_reply_tokens(client: openai.OpenAI) -> None:
    out = client.responses.create(
        input=QUESTION,
        max_output_tokens=4,
        temperature=0,
        extra_body={"enable_response_messages": True},
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    [prompt] = out.input_messages  # type: ignore[attr-defined]
    [reply] = out.output_messages  # type: ignore[attr-defined]
    assert prompt["type"] == reply["type"] == "raw_message_tokens"
    assert prompt["tokens"] == chat.prompt_token_ids  # type: ignore[attr-defined]
    assert QUESTION in prompt["message"]
    assert reply["tokens"] == chat.choices[0].token_ids  # type: ignore[attr-defined]
    assert reply["message"] == out.output_text == chat.choices[0].message.content
    plain = client.responses.create(input=QUESTION, max_output_tokens=1)
    assert "input_messages" not in plain.model_dump()


def test_reasoning_effort_reaches_the_template(scripted) -> None:
    server, orchestrator, tokenizer = scripted
    orchestrator.script, orchestrator.failure = [delta("ok", 1, "stop")], None
    out = sdk(server.base_url).responses.create(input=QUESTION, reasoning={"effort": "low"})
    messages = [{"role": "user", "content": QUESTION}]
    effort = {"reasoning_effort": "low", "enable_thinking": True}  # vLLM's two kwargs
    prompt = orchestrator.submitted[-1].prompt_ids
    assert prompt == tuple(tokenizer.apply_chat_template(messages, template_kwargs=effort))
    assert prompt != tuple(tokenizer.apply_chat_template(messages))
    assert out.reasoning is not None and out.reasoning.effort == "low"


def test_vllm_sampling_extras_reach_the_engine(scripted) -> None:
    server, orchestrator, tokenizer = scripted
    orchestrator.script, orchestrator.failure = [delta("ok", 1, "stop")], None
    extras = {
        "seed": 7,
        "top_k": 5,
        "presence_penalty": 0.5,
        "stop": ["END"],
        "stop_token_ids": [3],
        "ignore_eos": True,
        "logit_bias": {"11": 2.0},
        "repetition_penalty": 1.25,
    }
    sdk(server.base_url).responses.create(input=QUESTION, extra_body=extras)
    request = orchestrator.submitted[-1]
    sampling = request.sampling
    assert (sampling.seed, sampling.top_k, sampling.presence_penalty) == (7, 5, 0.5)
    assert request.stop == ("END",) and request.stop_token_ids == (3,) and request.ignore_eos
    assert dict(sampling.logit_bias or ()) == {11: 2.0} and sampling.repetition_penalty == 1.25
