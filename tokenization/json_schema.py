"""How a JSON schema is read for structured outputs: an object takes only the keys it lists.

Runs on: whoever builds a `GrammarSpec.json_schema` (the server's tokenizer threads),
the one place every JSON schema a client gives passes through (response_format,
structured_outputs.json, guided_json, the Responses API's text.format, the tool_choice
schema). Owns: `closed`, the rule that an object which does not set
`additionalProperties` takes only its listed keys. vLLM's default grammar backend
(xgrammar, in its strict mode) and OpenAI's strict mode read a schema so; llguidance
follows JSON Schema, where an open object takes any further key, and a random or
confused model then invents keys until max_tokens. An object that sets
`additionalProperties` (true, false or a schema for the extra values) keeps its say.
"""

from __future__ import annotations

import copy
from typing import Any

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


def closed(schema: Any) -> Any:
    """A copy of `schema` with each object that does not say otherwise closed to the keys
    it lists (`additionalProperties: false`); `schema` itself is left as given."""
    return _close(copy.deepcopy(schema))


def _close(schema: Any, partial: bool = False) -> Any:
    """`schema` closed in place. `partial`: `schema` is a part that others complete (an
    allOf member, or an anyOf / oneOf branch beside its object's own properties), so it
    is not closed itself. An object that combines schemas ($ref, allOf, anyOf, oneOf)
    stays open and its parts are closed; `not` and `if` stay as given (closing them would
    change what they allow).
    """
    if not isinstance(schema, dict):
        return schema
    own_keys = "properties" in schema or "patternProperties" in schema
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        for sub in value.values() if isinstance(value, dict) else ():
            _close(sub)
    for key in _SCHEMA_VALUES:
        _close(schema.get(key))
    parts = (("prefixItems", False), ("anyOf", own_keys), ("oneOf", own_keys), ("allOf", True))
    for key, partial_part in parts:
        value = schema.get(key)
        for sub in value if isinstance(value, list) else ():
            _close(sub, partial=partial_part)
    for key in ("then", "else"):
        _close(schema.get(key), partial=True)
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or own_keys) and not partial and not any(k in schema for k in _OPEN_BY_CHOICE):
        schema["additionalProperties"] = False
    return schema
