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


HOSTILE = "/v1/x\n2099-01-01 00:00:00,000 INFO forged\r\x1b[2K\x00\x7f\x85\u2028\u2029\u202e\ufeff"


def test_json_line_escapes_every_line_breaking_or_hiding_character() -> None:
    line = JsonFormatter().format(record(path=HOSTILE, emoji="ok \U0001f600 é"))
    assert line.isprintable() and len(line.splitlines()) == 1
    entry = json.loads(line)
    assert entry["path"] == HOSTILE and entry["emoji"] == "ok \U0001f600 é"


def test_text_line_quotes_and_escapes_client_strings() -> None:
    line = TextFormatter().format(record(path=HOSTILE + ' a="b" status=200', status=401))
    assert line.isprintable() and len(line.splitlines()) == 1
    assert line.endswith(" status=401")
    assert (
        'path="/v1/x\\n2099-01-01 00:00:00,000 INFO forged\\r\\x1b[2K\\x00\\x7f\\x85'
        '\\u2028\\u2029\\u202e\\ufeff a=\\"b\\" status=200"'
    ) in line
    plain = TextFormatter().format(record(path="/v1/models/tiny-test", reasons=["stop"]))
    assert "path=/v1/models/tiny-test reasons=['stop']" in plain


def test_text_message_and_traceback_cannot_start_a_line() -> None:
    try:
        raise ValueError("bad\n2099-01-01 00:00:00,000 INFO server.access: forged")
    except ValueError:
        rec = record()
        rec.msg, rec.args = "failed on %s", ("x\ny",)
        rec.exc_info = sys.exc_info()
    head, *details = TextFormatter().format(rec).split("\n")
    assert "failed on x\\ny" in head
    assert details and all(line.startswith("    ") and line.isprintable() for line in details)
    assert any("ValueError: bad" in line for line in details)
