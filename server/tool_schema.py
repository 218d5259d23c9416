"""The JSON schema a reply to tool_choice "required" or a named function must follow.

Owns: `tool_choice_schema`, the one place the structured-output constraint for tools
comes from (server.tools plans it, server.structured compiles it). vLLM's shapes: a
named function's parameters, or for "required" a non-empty list of calls, each exactly
`{"name", "parameters"}` (a closed object: nothing may follow its two keys). The list's
closing `]` ends the grammar, and with it the output.

Every object in a function's parameters that does not say otherwise takes only the
keys it lists (`_closed`), as vLLM's default grammar backend (xgrammar, in its strict
mode) reads a schema; llguidance follows JSON Schema, where an open object takes any
further key, and a random or confused model spells one key's name until max_tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

from server.errors import bad_request
from server.protocol import ChatTool, NamedToolChoice

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "contains")
_OPEN_BY_CHOICE = (
    "additionalProperties",
    "unevaluatedProperties",
    "$ref",
    "allOf",
    "anyOf",
    "oneOf",
)


def tool_choice_schema(
    tools: Sequence[ChatTool], choice: Literal["none", "auto", "required"] | NamedToolChoice
) -> dict[str, Any] | None:
    """The JSON schema the reply must follow under `choice`; None when any text may follow.

    vLLM's: a named function's parameters, or for "required" a non-empty list of
    `{"name", "parameters"}` objects over the tools, with their `$defs` hoisted to the
    top; parameters closed (`_closed`).
    """
    if isinstance(choice, NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        return _parameters(chosen[0]) if chosen else None
    if choice != "required" or not tools:
        return None
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        parameters = _parameters(tool)
        tool_defs = parameters.pop("$defs", None)
        for name, definition in (tool_defs if isinstance(tool_defs, dict) else {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(
                    f"tools define `$defs.{name}` differently; tool_choice required needs "
                    "one definition of each name",
                    param="tools",
                )
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,  # a call is these two keys, nothing after
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object"}}
    schema["items"]["anyOf"] = items
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(tool: ChatTool) -> dict[str, Any]:
    """A closed copy of the function's parameter schema; `{}` when it has none."""
    return _closed(copy.deepcopy(tool.function.parameters or _EMPTY_PARAMETERS))


def _closed(schema: Any, partial: bool = False) -> Any:
    """`schema` with each object that does not say otherwise closed to the keys it lists
    (`additionalProperties: false`), changed in place. `partial`: `schema` is a part that
    others complete (an allOf member, or an anyOf branch beside its object's own
    properties), so it is not closed itself. An object that combines schemas ($ref,
    allOf, anyOf, oneOf) stays open and its parts are closed; `not` and `if` stay as
    given (closing them would change what they allow).
    """
    if not isinstance(schema, dict):
        return schema
    own_keys = "properties" in schema or "patternProperties" in schema
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        for sub in value.values() if isinstance(value, dict) else ():
            _closed(sub)
    for key in _SCHEMA_VALUES:
        _closed(schema.get(key))
    parts = (("prefixItems", False), ("anyOf", own_keys), ("oneOf", own_keys), ("allOf", True))
    for key, partial_part in parts:
        value = schema.get(key)
        for sub in value if isinstance(value, list) else ():
            _closed(sub, partial=partial_part)
    for key in ("then", "else"):
        _closed(schema.get(key), partial=True)
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or own_keys) and not partial and not any(k in schema for k in _OPEN_BY_CHOICE):
        schema["additionalProperties"] = False
    return schema
