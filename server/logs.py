"""Structured logs: one JSON object per line (or plain text), configured only by `main`.

`configure_logging` is called once, from the entrypoint; every module just
uses `logging.getLogger(__name__)` and passes fields through `extra=`.

Invariant: one record is one line, whatever a client put into it. Paths, header
values and error strings reach the log, so every character that could end a line,
move the cursor or hide text (controls, line and paragraph separators, bidi and
zero-width format characters) is written as an escape sequence in both formats;
in text, a value with a space, `=` or `"` is quoted, so no value can pose as a field.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# attributes every LogRecord has; anything else came in through `extra=`
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
_ODD = re.compile(r"[^\x20-\x7e]")  # candidates: the printable ones among them stay
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_QUOTED = {"\\": "\\\\", '"': '\\"'}
_BARE_VALUE = re.compile(r'[^\s"=\\]+')
DETAIL_INDENT = "    "  # traceback lines: never at column 0, where records start


def _code(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    point = ord(ch)
    if point <= 0xFF:
        return f"\\x{point:02x}"
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def _json_code(ch: str) -> str:
    point = ord(ch)
    if point <= 0xFFFF:
        return f"\\u{point:04x}"
    point -= 0x10000
    return f"\\u{0xD800 + (point >> 10):04x}\\u{0xDC00 + (point & 0x3FF):04x}"


def escape(text: str) -> str:
    """`text` with every non-printable character written as a Python-style escape."""
    return _ODD.sub(lambda m: m[0] if m[0].isprintable() else _code(m[0]), text)


def text_value(value: object) -> str:
    """A field value for `key=value`: bare when safe, else double-quoted and escaped."""
    text = str(value)
    if _BARE_VALUE.fullmatch(text) and text.isprintable():
        return text
    inner = "".join(_QUOTED.get(ch) or (ch if ch.isprintable() else _code(ch)) for ch in text)
    return f'"{inner}"'


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """A log record as one JSON line: time, level, logger, message, extra fields, traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        line = json.dumps(entry, default=str, ensure_ascii=False)
        # json escapes C0 controls; U+2028, NEL, bidi overrides and the like pass raw and
        # split lines in some readers (str.splitlines, JavaScript) or hide text: escape them.
        # Outside strings a JSON line is ASCII, so this only touches string contents.
        return _ODD.sub(lambda m: m[0] if m[0].isprintable() else _json_code(m[0]), line)


class TextFormatter(logging.Formatter):
    """Plain text with the extra fields appended as key=value, one record a line.

    A traceback follows on indented lines, so a line that starts at column 0 is
    always the start of a record.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        extras = [f"{escape(k)}={text_value(v)}" for k, v in _extras(record).items()]
        if extras:
            line += " " + " ".join(extras)
        details = []
        if record.exc_info:
            details.append(self.formatException(record.exc_info))
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        for block in details:
            for detail in block.splitlines():
                line += "\n" + DETAIL_INDENT + escape(detail)
        return line


def configure_logging(level: str, log_format: str) -> None:
    """Send every logger (uvicorn's too) to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # the server logs each request itself
