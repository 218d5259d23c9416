"""Tool-call formats of model families: pure functions from generated text to calls.

Owns: reading a finished output as text and tool calls (`ToolParser.parse`), and
saying how much of an unfinished one is text whatever comes next
(`ToolParser.text_until`), so a stream can send that much as content and hold the
rest until the output ends. Output that looks like a call but is not valid JSON of
one stays text, as vLLM's parsers keep it. The formats, named as vLLM's
`--tool-call-parser` names them:

- `hermes` (Hermes, Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  once per call; the last call may lack its closing tag (the model ended instead).
- `llama3_json` (Llama 3.1 to 3.3, 4): `{"name": ..., "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several joined by ";".

Either parser takes "arguments" or "parameters", and a call without either has `{}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_JSON_ERRORS = (ValueError, RecursionError)  # RecursionError: absurdly deep nesting


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedOutput:
    """A finished output: its text outside any calls, and the calls in order."""

    content: str | None  # with calls: None when the text outside them is blank
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], ParsedOutput]
    # (output so far, an index up to which it is known to be text) -> a larger such index
    text_until: Callable[[str, int], int]


def _text(text: str) -> ParsedOutput:
    """An output without calls: all of it is content, unchanged."""
    return ParsedOutput(text)


def _with_calls(outside: Sequence[str], calls: list[ParsedCall]) -> ParsedOutput:
    joined = "".join(outside)
    return ParsedOutput(joined if joined.strip() else None, tuple(calls))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except _JSON_ERRORS:
        return None


def _call(obj: Any) -> ParsedCall | None:
    """A call from `{"name": str, "arguments" | "parameters": object}`, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _until_marker(text: str, start: int, marker: str) -> int:
    """Where `marker` starts, or where a tail that may still grow into it starts."""
    found = text.find(marker, start)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


# --- hermes -----------------------------------------------------------------------------


def parse_hermes(text: str) -> ParsedOutput:
    calls: list[ParsedCall] = []
    outside: list[str] = []
    at = 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        outside.append(text[at:start])
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        call = _call(_loads(text[body_at:] if end < 0 else text[body_at:end]))
        if call is None:
            return _text(text)  # one malformed call and the whole output is text (vLLM)
        calls.append(call)
        at = len(text) if end < 0 else end + len(HERMES_CLOSE)
    if not calls:
        return _text(text)
    outside.append(text[at:])
    return _with_calls(outside, calls)


def hermes_text_until(text: str, start: int) -> int:
    return _until_marker(text, start, HERMES_OPEN)


# --- llama3_json ------------------------------------------------------------------------


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def parse_llama3_json(text: str) -> ParsedOutput:
    tag, brace = text.find(PYTHON_TAG), text.find("{")
    if tag >= 0 and (brace < 0 or tag < brace):
        before, at = text[:tag], tag + len(PYTHON_TAG)
    elif brace >= 0:
        before, at = text[:brace], brace
    else:
        return _text(text)
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    while True:
        try:
            obj, at = decoder.raw_decode(text, _skip_blanks(text, at))
        except _JSON_ERRORS:
            return _text(text)
        call = _call(obj)
        if call is None:
            return _text(text)
        calls.append(call)
        at = _skip_blanks(text, at)
        if not text.startswith(";", at):
            break
        at += 1
    return _with_calls([before, text[at:]], calls)


def llama3_json_text_until(text: str, start: int) -> int:
    brace = text.find("{", start)
    tag = _until_marker(text, start, PYTHON_TAG)
    return tag if brace < 0 else min(brace, tag)


# --- tool_choice "required" -------------------------------------------------------------


def parse_required(text: str) -> ParsedOutput | None:
    """vLLM's reply to tool_choice "required": a JSON list of {"name", "parameters"}."""
    items = _loads(text)
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item) for item in items]
    if any(call is None for call in calls):
        return None
    return ParsedOutput(None, tuple(call for call in calls if call is not None))


PARSERS: dict[str, ToolParser] = {
    parser.name: parser
    for parser in (
        ToolParser("hermes", parse_hermes, hermes_text_until),
        ToolParser("llama3_json", parse_llama3_json, llama3_json_text_until),
    )
}
