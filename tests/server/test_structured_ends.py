"""JSON schemas whose objects do not set `additionalProperties` end on a random model.

Such an object takes only the keys it lists (vLLM's default grammar backend and OpenAI's
strict mode read a schema so): a random-weight model under each shape the structured-output
tests use (nested objects, arrays of objects, anyOf, $ref) ends with valid JSON and
finish_reason "stop", through every field a client can give a schema in. An explicit
`additionalProperties: true` keeps the object open.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.harness import MODEL_NAME, LiveServer

PROMPT = "The quick brown fox"
BUDGET = 100  # the longest of the 120 answers took 74 tokens (whitespace bounded per gap)
SEEDS = range(20)

ANSWER = {  # the issue's schema, as a new user wrote it
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
}
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "y": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["x", "y"],
}
SHAPES: dict[str, dict[str, Any]] = {
    "answer": ANSWER,
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {"pet": PERSON["properties"]["pet"], "home": POINT},
                "required": ["pet", "home"],
            }
        },
        "required": ["owner"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {"points": {"type": "array", "items": POINT, "maxItems": 2}},
        "required": ["points"],
    },
    "any_of": {
        "type": "object",
        "properties": {"contact": {"anyOf": [POINT, ANSWER, {"type": "boolean"}]}},
        "required": ["contact"],
    },
    "ref": {
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "$defs": {"point": POINT},
    },
}


def _field(schema: dict[str, Any], seed: int) -> dict[str, Any]:
    """The request fields that give `schema`, a different place for each seed in turn."""
    strict = {"name": "s", "schema": schema, "strict": True}
    loose = {"name": "s", "schema": schema, "strict": False}
    places = [
        {"response_format": {"type": "json_schema", "json_schema": strict}},
        {"response_format": {"type": "json_schema", "json_schema": loose}},
        {"structured_outputs": {"json": schema}},
        {"guided_json": schema},
    ]
    return places[seed % len(places)]


def _complete(live: LiveServer, schema: dict[str, Any], seed: int) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": BUDGET, "temperature": 1.0,
        "seed": seed, **_field(schema, seed),
    }  # fmt: skip
    response = httpx.post(live.v1 + "/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_an_object_without_additional_properties_ends_with_valid_json(
    live: LiveServer, shape: str
) -> None:
    schema = SHAPES[shape]
    with ThreadPoolExecutor(4) as pool:  # the test server's 4 slots
        choices = list(pool.map(lambda seed: _complete(live, schema, seed), SEEDS))
    for seed, choice in zip(SEEDS, choices, strict=True):
        assert choice["finish_reason"] == "stop", (seed, choice["text"])
        value = json.loads(choice["text"])
        jsonschema.validate(value, _closed_copy(schema))


def _closed_copy(schema: Any) -> Any:
    """`schema` with every object that lists properties taking only those (for checking)."""
    if isinstance(schema, list):
        return [_closed_copy(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_copy(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def test_responses_text_format_ends_with_valid_json(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)
    for strict in (True, False, True, False):  # sampled: the Responses API takes no seed
        response = client.responses.create(
            model=MODEL_NAME, input="Describe a person.", max_output_tokens=BUDGET,
            temperature=1.0,
            text={"format": {"type": "json_schema", "name": "person", "schema": SHAPES["nested"],
                             "strict": strict}},
        )  # fmt: skip
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), _closed_copy(SHAPES["nested"]))


def test_additional_properties_true_keeps_the_object_open(live: LiveServer) -> None:
    """An object that says it takes more keys may write them: with its one listed key
    optional, some seed writes first a key the schema does not list."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": True,
    }
    first_keys = set()
    for seed in range(6):
        body = {
            "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0,
            "seed": seed, "structured_outputs": {"json": schema},
        }  # fmt: skip
        choice = httpx.post(live.v1 + "/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["text"].startswith("{"), choice
        if choice["text"].startswith('{"'):
            first_keys.add(choice["text"][2:].split('"')[0])
    assert first_keys - {"a"}, first_keys
