"""tokenization.json_schema: an object that does not set additionalProperties takes only the
keys it lists, in every schema a GrammarSpec is built from; one that says otherwise, or
combines schemas, keeps its say; the client's schema itself is never changed."""

from __future__ import annotations

import copy
import json

from tokenization.grammar import GrammarSpec
from tokenization.json_schema import closed


def point() -> dict:  # a fresh copy each time, as a request's JSON has them
    return {"type": "object", "properties": {"x": {"type": "integer"}}}


CLOSED_POINT = {**point(), "additionalProperties": False}


def test_objects_are_closed_unless_they_say_or_combine() -> None:
    schema = {
        "type": "object",
        "properties": {
            "at": point(),
            "path": {"type": "array", "items": point(), "prefixItems": [point()]},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "tagged": {"type": "object", "additionalProperties": point()},
            "extra": {"type": "object", "additionalProperties": True},
            "either": {"anyOf": [point(), {"type": "string"}]},
            "one": {"oneOf": [point(), {"type": "null"}]},
            "both": {"allOf": [point(), {"properties": {"y": {"type": "integer"}}}]},
            "ref": {"$ref": "#/$defs/point"},
            "old_ref": {"$ref": "#/definitions/point"},
            "not": {"not": point()},
            "maybe": {"type": ["object", "null"], "properties": {"z": {"type": "string"}}},
        },
        "$defs": {"point": point()},
        "definitions": {"point": point()},
    }
    given = copy.deepcopy(schema)
    assert closed(schema) == {
        "type": "object",
        "properties": {
            "at": CLOSED_POINT,
            "path": {"type": "array", "items": CLOSED_POINT, "prefixItems": [CLOSED_POINT]},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            # the extra values' schema is a schema like any other: its objects are closed
            "tagged": {"type": "object", "additionalProperties": CLOSED_POINT},
            "extra": {"type": "object", "additionalProperties": True},
            "either": {"anyOf": [CLOSED_POINT, {"type": "string"}]},
            "one": {"oneOf": [CLOSED_POINT, {"type": "null"}]},
            "both": {"allOf": [point(), {"properties": {"y": {"type": "integer"}}}]},  # parts
            "ref": {"$ref": "#/$defs/point"},
            "old_ref": {"$ref": "#/definitions/point"},
            "not": {"not": point()},
            "maybe": {"type": ["object", "null"], "properties": {"z": {"type": "string"}},
                      "additionalProperties": False},
        },
        "$defs": {"point": CLOSED_POINT},
        "definitions": {"point": CLOSED_POINT},
        "additionalProperties": False,
    }  # fmt: skip
    assert schema == given  # a copy is closed, not the client's schema


def test_branches_beside_own_properties_add_to_them() -> None:
    beside = {"type": "object", "properties": {"kind": {"type": "string"}},
              "anyOf": [{"properties": {"a": {"type": "integer"}}}]}  # fmt: skip
    assert closed(beside) == beside


def test_non_objects_and_open_objects_stay_as_given() -> None:
    for schema in (True, False, {}, {"type": "string"}, {"type": "array", "items": True},
                   {"type": "object", "additionalProperties": True},
                   {"type": "object", "unevaluatedProperties": {"type": "integer"}}):  # fmt: skip
        assert closed(schema) == schema


def test_every_json_grammar_spec_is_closed() -> None:
    """GrammarSpec.json_schema is the one door: what it compiles is the closed schema."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": point()}})
    assert json.loads(spec.text) == {
        "type": "object",
        "properties": {"a": CLOSED_POINT},
        "additionalProperties": False,
    }
    assert json.loads(GrammarSpec.json_schema({"type": "object"}).text) == {
        "type": "object",
        "additionalProperties": False,
    }
