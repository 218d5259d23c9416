"""The JSON schema a reply to tool_choice "required" or a named function must follow.

Owns: `tool_choice_schema`, the one place the structured-output constraint for tools
comes from (server.tools plans it, server.structured compiles it). vLLM's shapes: a
named function's parameters, or for "required" a non-empty list of calls, each exactly
`{"name", "parameters"}` (a closed object: nothing may follow its two keys). The list's
closing `]` ends the grammar, and with it the output.

Every object in a function's parameters that does not say otherwise takes only the
keys it lists, as in every JSON schema a request gives: tokenization.json_schema closes
them when the schema becomes a GrammarSpec.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

from server.errors import bad_request
from server.protocol import ChatTool, NamedToolChoice

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_choice_schema(
    tools: Sequence[ChatTool], choice: Literal["none", "auto", "required"] | NamedToolChoice
) -> dict[str, Any] | None:
    """The JSON schema the reply must follow under `choice`; None when any text may follow.

    vLLM's: a named function's parameters, or for "required" a non-empty list of
    `{"name", "parameters"}` objects over the tools, with their `$defs` hoisted to the
    top.
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
    """A copy of the function's parameter schema (its `$defs` are hoisted from it); an
    empty object when it has none."""
    return copy.deepcopy(tool.function.parameters or _EMPTY_PARAMETERS)
