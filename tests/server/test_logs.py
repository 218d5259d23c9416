"""Structured log lines: one JSON object per line with the `extra=` fields, or text."""

from __future__ import annotations

import json
import logging
import sys

from server.logs import JsonFormatter, TextFormatter


def record(**extra: object) -> logging.LogRecord:
    rec = logging.makeLogRecord({"name": "server.access", "levelno": 20, "levelname": "INFO"})
    rec.msg = "request %s"
    rec.args = ("done",)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_line_carries_extra_fields() -> None:
    line = JsonFormatter().format(record(request_id="r1", status=200, prompt_tokens=3))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "request done" and entry["level"] == "info"
    assert (entry["request_id"], entry["status"], entry["prompt_tokens"]) == ("r1", 200, 3)
    assert entry["time"].endswith("Z")


def test_json_line_keeps_the_traceback_in_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        rec = record()
        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    assert "RuntimeError: boom" in json.loads(line)["traceback"]


def test_text_format_appends_fields() -> None:
    line = TextFormatter().format(record(request_id="r2", status=404))
    assert "request done" in line and "request_id=r2" in line and "status=404" in line
