"""Structured outputs through the real server (tiny random model) and the official openai SDK.

Every constrained output must follow its schema, regex, choice or grammar and end with
"stop" well within max_tokens (a random model under a compact JSON grammar cannot pad
with whitespace); streamed text equals the whole response at temperature 0; a bad
constraint is a 400 naming it before any stream starts; tool_choice required / named
replies follow the functions' parameters.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.harness import MODEL_NAME, LiveServer

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Describe a person."}]
BUDGET = 80  # with the chat prompt (~30 tokens) within the test server's 128
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def completion(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one completion, streamed or not."""
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": BUDGET, **kwargs}
    if "response_format" in kwargs:  # vLLM's extra on completions: not in the SDK's signature
        extra = kwargs.setdefault("extra_body", {})
        extra["response_format"] = kwargs.pop("response_format")
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": BUDGET, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


ENDPOINTS = [completion, chat]


def so(**entry: Any) -> dict[str, Any]:
    """vLLM's structured_outputs field, as the SDK sends extra fields."""
    return {"extra_body": {"structured_outputs": entry}}


CASES = {
    "json_schema": ({"response_format": RESPONSE_FORMAT}, lambda t: _valid(t, PERSON)),
    "so_json": (so(json=PERSON), lambda t: _valid(t, PERSON)),
    "so_json_text": (so(json=json.dumps(PERSON)), lambda t: _valid(t, PERSON)),
    "regex": (so(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    "choice": (
        so(choice=["red", "green", "blue sky"]),
        lambda t: t in ("red", "green", "blue sky"),
    ),
    "gbnf": (so(grammar='root ::= "yes" | "no" | "n/a"'), lambda t: t in ("yes", "no", "n/a")),
    "lark": (
        so(grammar='start: ("ab" | "cd") ("ab" | "cd")? "!"'),
        lambda t: re.fullmatch(r"(ab|cd){1,2}!", t),
    ),
    "guided_regex": (
        {"extra_body": {"guided_regex": "[xyz]{4}"}},
        lambda t: re.fullmatch("[xyz]{4}", t),
    ),
}


def _valid(text: str, schema: dict[str, Any]) -> bool:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return isinstance(value, dict)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=["completions", "chat"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_constrained_output_conforms_and_streams_the_same(
    client: openai.OpenAI, endpoint, case: str
) -> None:
    kwargs, conforms = CASES[case]
    text, finish = endpoint(client, False, temperature=0, **kwargs)
    assert finish == "stop", text
    assert conforms(text), text
    assert endpoint(client, True, temperature=0, **kwargs) == (text, finish)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=["completions", "chat"])
@pytest.mark.parametrize(
    "kwargs",
    [{"response_format": {"type": "json_object"}}, so(json_object=True)],
    ids=["response_format", "structured_outputs"],
)
def test_json_object_is_an_object(client: openai.OpenAI, endpoint, kwargs) -> None:
    """Any object: a random model may not close it within the budget (its keys are free
    strings), but what it writes is an object, compact, and ends when it closes."""
    text, finish = endpoint(client, False, temperature=0, **kwargs)
    assert text.startswith("{") and finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    assert endpoint(client, True, temperature=0, **kwargs) == (text, finish)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=["completions", "chat"])
def test_sampled_outputs_conform_and_end(client: openai.OpenAI, endpoint) -> None:
    for seed in range(3):
        text, finish = endpoint(
            client, seed % 2 == 1, temperature=1.0, seed=seed, **so(json=PERSON)
        )
        assert finish == "stop" and _valid(text, PERSON), text


def test_n_samples_each_conform(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=BUDGET, n=3, temperature=1.0, seed=7,
        extra_body={"response_format": RESPONSE_FORMAT},
    )  # fmt: skip
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "stop" and _valid(choice.text, PERSON), choice.text


def test_the_grammar_ends_the_output_despite_ignore_eos_and_min_tokens(
    client: openai.OpenAI,
) -> None:
    extra = {"structured_outputs": {"choice": ["yes"]}, "ignore_eos": True, "min_tokens": 20}
    text, finish = completion(client, False, temperature=0, extra_body=extra)
    assert (text, finish) == ("yes", "stop")


def test_chat_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=120)
        admin: bool

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=BUDGET,
        temperature=0,
        response_format=Person,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content or "") == message.parsed


# as JSON text: the body parser refuses nesting past 64 levels, this is read afterwards
DEEP = '{"type":"array","items":' * 300 + "{}" + "}" * 300
DEEPER = '{"type":"array","items":' * 5000 + "{}" + "}" * 5000  # past Python's recursion
BAD = {
    "schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        "response_format",
        "objekt",
    ),
    "ref": (
        {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
        "structured_outputs",
        "missing",
    ),
    "regex": ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed"),
    "grammar": (
        {"structured_outputs": {"grammar": "root ::= ( "}},
        "structured_outputs",
        "grammar",
    ),
    "two_keys": (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
        "exactly one",
    ),
    "two_fields": (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "one output constraint",
    ),
    "format_type": ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    "deep": ({"structured_outputs": {"json": DEEP}}, "structured_outputs", "recursion"),
    "deeper": ({"structured_outputs": {"json": DEEPER}}, "structured_outputs", "JSON"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_constraint_is_a_400_before_any_stream(
    live: LiveServer, case: str, path: str, stream: bool
) -> None:
    fields, param, named = BAD[case]
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "stream": stream, **fields}
    body.update({"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES})
    response = httpx.post(live.v1 + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert named in error["message"]


def test_the_sdk_raises_bad_request_streaming_too(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="unclosed"):
        completion(client, True, **so(regex="(unclosed"))


def test_pathological_constraints_are_bounded(live: LiveServer) -> None:
    """Huge constraints are refused by size; catastrophic-backtracking patterns cost nothing
    special (llguidance builds its automata lazily, within fuel limits) and are served."""
    refused = [
        {"json": {"enum": [f"v{i}" for i in range(20_000)]}},  # ~150 kB: past the size limit
        {"regex": "(a|aa)*b" * 10_000},
    ]
    served = [{"regex": "(a|aa)*b"}, {"regex": "(.*a){30}"}, {"regex": "[a-z]{1000}{1000}{1000}"}]
    for entry in refused + served:
        started = time.monotonic()
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "structured_outputs": entry}
        response = httpx.post(live.v1 + "/completions", json=body, timeout=60)
        want = 400 if entry in refused else 200
        assert response.status_code == want, (entry.keys(), response.text[:200])
        assert time.monotonic() - started < 10
        if want == 400:
            assert "at most" in response.json()["error"]["message"]


def test_a_repeated_schema_is_compiled_once(live: LiveServer, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"k": {"const": 42}}, "required": ["k"]}
    first = completion(client, False, temperature=0, **so(json=schema))
    started = time.monotonic()
    assert completion(client, False, temperature=0, **so(json=schema)) == first
    assert json.loads(first[0]) == {"k": 42}
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_arguments_follow_the_parameters(
    client: openai.OpenAI, stream: bool
) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=BUDGET, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        arguments = calls[0].function.arguments
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather"
        arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_required_tool_choice_calls_follow_their_functions(client: openai.OpenAI) -> None:
    """With parallel_tool_calls false the reply is one call (the schema's maxItems 1), so a
    random model ends it within the budget."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=BUDGET, temperature=1.0, seed=seed,
            tools=TOOLS, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        jsonschema.validate(
            json.loads(calls[0].function.arguments), schemas[calls[0].function.name]
        )


# -- property tests: random small schemas and regexes ------------------------------------

SCALARS = st.sampled_from(
    [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"type": "string", "maxLength": 6},
        {"enum": ["a", "b", 3, None]},
        {"const": "fixed"},
    ]
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    properties = st.dictionaries(st.sampled_from(["a", "bb", "c_1", "d"]), children, max_size=3)
    return properties.map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


def _arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return children.map(lambda item: {"type": "array", "items": item, "maxItems": 2})


SCHEMAS = st.recursive(SCALARS, lambda c: _objects(c) | _arrays(c), max_leaves=4)
REGEXES = st.lists(
    st.sampled_from(["[a-c]", "[0-9]{1,3}", "(x|yz)", "-", "[A-Z]?", "(ab){1,3}", r"\.", "q{2}"]),
    min_size=1,
    max_size=4,
).map("".join)
PROPERTY = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is one to reproduce
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# Two-item arrays of objects with 6-character strings, at temperature 1 on the random
# tiny model, ran to 85 tokens (3-4 byte-level tokens a character, the grammar's bounded
# whitespace): within the test server's 128 with this short prompt.
SCHEMA_BUDGET = 120


@PROPERTY
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_random_schemas_give_conforming_json(live: LiveServer, schema: dict, seed: int) -> None:
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": SCHEMA_BUDGET,
        "temperature": 1.0, "seed": seed, "structured_outputs": {"json": schema},
    }  # fmt: skip
    choice = httpx.post(live.v1 + "/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), schema)


@PROPERTY
@given(pattern=REGEXES, seed=st.integers(0, 2**31 - 1))
def test_random_regexes_give_matching_text(live: LiveServer, pattern: str, seed: int) -> None:
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0,
        "seed": seed, "structured_outputs": {"regex": pattern},
    }  # fmt: skip
    choice = httpx.post(live.v1 + "/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert re.fullmatch(pattern, choice["text"]), (pattern, choice["text"])
