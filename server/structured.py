"""Structured outputs: a request's output constraint, read from the API and compiled.

Runs on: the server's tokenizer threads, while a request is planned, so an invalid
schema, regex or grammar is a 400 naming the problem before anything is queued
(streamed requests too: no stream has started yet). Owns: the request shapes that
ask for a constraint and the rule that a request asks for at most one:

- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (`strict` or not, the schema is
  enforced);
- vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or as
  JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF/EBNF)
  or `json_object: true`;
- the `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields vLLM
  removed, read as the matching `structured_outputs` entry, so older clients keep
  their constraint instead of having it dropped;
- chat's and the Responses API's `tool_choice` "required" or a named function,
  constrained to the schema server.tools gives (vLLM's behaviour); it wins over any
  other constraint the request asks for, as vLLM's does;
- the Responses API's `text.format`: `{"type": "json_object"}` or `{"type":
  "json_schema", "name", "schema", "strict"}` (flat; enforced either way).

JSON whitespace is bounded (one space, or a line break and an indent, between two
tokens: tokenization.grammar), so a model cannot pad its budget
with blanks, and an object in a schema that does not set `additionalProperties` takes
only the keys it lists (vLLM's and OpenAI's strict reading; `strict` false reads the same):
`GrammarSpec.json_schema` applies that rule, once, to every schema from every field above.
"""

from __future__ import annotations

import json
from typing import Any

from engine.types import TokenConstraint
from server.backend import ModelLimits, TokenizerClient
from server.errors import bad_request
from server.protocol import ResponsesTextFormat, SamplingFields
from tokenization.grammar import GrammarError, GrammarSpec

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
UNSUPPORTED_KEYS = ("structural_tag", "whitespace_pattern")
# json_object: any object, so it says it is open (objects that do not are closed)
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}


def requested(
    request: SamplingFields, tool_schema: dict[str, Any] | None = None
) -> tuple[GrammarSpec, str] | None:
    """The constraint the request asks for and the field that asked (None: free text)."""
    asked: list[tuple[GrammarSpec, str]] = []
    if request.response_format is not None:
        spec = _response_format(request.response_format)
        if spec is not None:
            asked.append((spec, "response_format"))
    if request.structured_outputs is not None:
        asked.append((_structured(request.structured_outputs), "structured_outputs"))
    for field, key in LEGACY_FIELDS.items():
        value = getattr(request, field)
        if value is not None:
            asked.append((_structured({key: value}, field), field))
    return _one(asked, tool_schema)


def requested_by_response(
    text_format: ResponsesTextFormat | None, tool_schema: dict[str, Any] | None = None
) -> tuple[GrammarSpec, str] | None:
    """The constraint a Responses request asks for (`text.format`, tool_choice), if any."""
    spec = _text_format(text_format) if text_format is not None else None
    return _one([(spec, "text")] if spec is not None else [], tool_schema)


def _one(
    asked: list[tuple[GrammarSpec, str]], tool_schema: dict[str, Any] | None
) -> tuple[GrammarSpec, str] | None:
    """The one constraint asked for; more than one is a 400. tool_choice's (required or a
    named function) wins over the others, as in vLLM, whose tool parser replaces the
    request's structured outputs and response_format with it."""
    if tool_schema is not None:
        return GrammarSpec.json_schema(tool_schema), "tool_choice"
    if len(asked) > 1:
        fields = ", ".join(param for _, param in asked)
        raise bad_request(
            f"a request may ask for one output constraint, got several ({fields})",
            param=asked[1][1],
        )
    return asked[0] if asked else None


def compile_constraint(
    asked: tuple[GrammarSpec, str] | None, tokenizer: TokenizerClient, limits: ModelLimits
) -> TokenConstraint | None:
    """The compiled constraint (cached by the compiler); a 400 naming the field and the
    problem when it does not compile or is too complex."""
    if asked is None:
        return None
    spec, param = asked
    try:
        compiled: TokenConstraint = tokenizer.grammar_compiler(limits.vocab_size).compile(spec)
    except GrammarError as exc:
        raise bad_request(str(exc), param=param, code="invalid_constraint") from exc
    return compiled


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema(ANY_OBJECT)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            param="response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with name and schema",
            param="response_format",
        )
    schema = spec.get("schema", spec.get("json_schema"))
    if not isinstance(schema, dict | bool):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format",
        )
    return GrammarSpec.json_schema(schema)


def _text_format(value: ResponsesTextFormat) -> GrammarSpec | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return GrammarSpec.json_schema(ANY_OBJECT)
    if value.type != "json_schema":
        raise bad_request(
            f"text.format.type must be text, json_object or json_schema, got {value.type!r}",
            param="text",
        )
    if value.json_schema is None:
        raise bad_request("text.format.schema is required for json_schema", param="text")
    return GrammarSpec.json_schema(value.json_schema)


def _structured(value: Any, param: str = "structured_outputs") -> GrammarSpec:
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param=param)
    for key in UNSUPPORTED_KEYS:
        if value.get(key) is not None:
            raise bad_request(f"{param}.{key} is not supported", param=param, code="unsupported")
    given = [
        key for key in STRUCTURED_KEYS if value.get(key) is not None and value.get(key) is not False
    ]
    if len(given) != 1:
        raise bad_request(
            f"{param} must set exactly one of {', '.join(STRUCTURED_KEYS)}, got "
            f"{', '.join(given) or 'none'}",
            param=param,
        )
    key = given[0]
    item = value[key]
    if key == "json_object":
        return GrammarSpec.json_schema(ANY_OBJECT)
    if key == "json":
        return GrammarSpec.json_schema(_schema(item, param))
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise bad_request(f"{param}.choice must be a non-empty list of strings", param=param)
        if not all(item):
            raise bad_request(f"{param}.choice must not hold an empty string", param=param)
        return GrammarSpec.choice(item)
    if not isinstance(item, str) or not item:
        raise bad_request(f"{param}.{key} must be a non-empty string", param=param)
    return GrammarSpec("regex" if key == "regex" else "grammar", item)


def _schema(item: Any, param: str) -> Any:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except (ValueError, RecursionError) as exc:
            raise bad_request(f"{param}.json is not valid JSON: {exc}", param=param) from exc
    if not isinstance(item, dict | bool):
        raise bad_request(f"{param}.json must be a JSON schema object", param=param)
    return item
