"""Hostile clients: forged log lines, stalled sockets, bodies sent to a locked server, cut
streams, and the schema a client reads.

Raw sockets play the slow clients (a request written a byte at a time is not something
httpx can do); everything listens on 127.0.0.1. The deadlines are small and set by flags,
and every bound a test asserts is several seconds wider than the deadline it checks, so a
loaded machine passes; what fails is a socket that is never cut.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.harness import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPO_ROOT,
    SLOTS,
    LiveServer,
    ServerProcess,
    make_config,
    serve_in_thread,
    serve_process,
)

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_S, BODY_S, KEEP_ALIVE_S = 1.0, 2.0, 1.0
SLACK_S = 8.0  # on top of every deadline: a loaded 2-core machine is late, never early
PROCESS_FLAGS = [
    "--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_MODEL_LEN),
    "--served-model-name", MODEL_NAME,
    "--log-format", "text", "--log-level", "info", "--api-key", KEY,
    "--header-read-timeout", str(HEADER_S), "--body-read-timeout", str(BODY_S),
    "--timeout-keep-alive", str(KEEP_ALIVE_S),
]  # fmt: skip
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


@pytest.fixture(scope="module")
def process(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """`python -m server` with text logs, an API key and one- and two-second deadlines."""
    args = ["--model", str(tiny_checkpoint), *PROCESS_FLAGS]
    with serve_process(args, tmp_path_factory.mktemp("security")) as server:
        yield server


@pytest.fixture(scope="module")
def locked(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    """An in-thread server with an API key and a short body deadline."""
    config = make_config(tiny_checkpoint, api_key=KEY, body_read_timeout=BODY_S)
    with serve_in_thread(config) as server:
        yield server


# ---- raw-socket clients ----------------------------------------------------------------


def connect(base_url: str) -> socket.socket:
    parts = urlsplit(base_url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def hold(sock: socket.socket, drip: bytes = b"", every_s: float = 0.2, limit_s: float = 30):
    """Send `drip` a byte every `every_s` while reading, until the server hangs up.

    Returns (seconds until the hang-up, the bytes the server sent); raises when the
    server still holds the socket after `limit_s`.
    """
    started = time.monotonic()
    received = b""
    sent = 0
    with sock:
        while time.monotonic() - started < limit_s:
            readable, _, _ = select.select([sock], [], [], every_s)
            try:
                if readable:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return time.monotonic() - started, received
                    received += chunk
                elif sent < len(drip):
                    sock.sendall(drip[sent : sent + 1])
                    sent += 1
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - started, received
    raise AssertionError(f"the server held the socket for {limit_s} s; it sent {received!r}")


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


# ---- 5: log forging ----------------------------------------------------------------------

# percent-encoded: newline, carriage return, escape, NUL, DEL, NEL, U+2028, a bidi override,
# and a fake record on the "next line"
FORGED = (
    "/v1/models/FORGED%0a2099-01-01 00:00:00,000 INFO server.access: request status=200"
    "%0d%1b[31m%00%7f%c2%85%e2%80%a8%e2%80%ae status=200"
)
RAW_FORBIDDEN = ["\r", "\x1b", "\x00", "\x7f", "\x85", "\u2028", "\u202e"]


def access_lines(server: ServerProcess, request_id: str, limit_s: float = 20) -> list[str]:
    deadline = time.monotonic() + limit_s
    while True:
        lines = [line for line in server.log().split("\n") if f"request_id={request_id} " in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.mark.slow
def test_text_log_escapes_what_clients_send(process: ServerProcess) -> None:
    """A 401 and a 404 to a path full of control characters: one escaped line each."""
    base = process.base_url
    with httpx.Client(base_url=base, timeout=30) as client:
        refused = client.get(FORGED, headers={"X-Request-Id": "forge-401"})
        missing = client.get(FORGED, headers={**AUTH, "X-Request-Id": "forge-404"})
    assert refused.status_code == 401 and missing.status_code == 404
    for request_id, status in (("forge-401", 401), ("forge-404", 404)):
        (line,) = access_lines(process, request_id)
        assert TIMESTAMP.match(line), line
        assert f" status={status} " in line, line
        # the path is one quoted value: the fake "status=200" inside it is no field
        assert re.search(r'path="/v1/models/FORGED\\n2099-01-01 .*\\r\\x1b\[31m', line), line
        for escaped in ("\\x00", "\\x7f", "\\x85", "\\u2028", "\\u202e"):
            assert escaped in line, (escaped, line)
    log = process.log()
    assert all(ch not in log for ch in RAW_FORBIDDEN), "a raw control character reached the log"
    assert [line for line in log.split("\n") if line.startswith("2099")] == []
    assert log.count("FORGED") == 2


# ---- 7: stalled connections ----------------------------------------------------------------


@pytest.mark.slow
def test_stalled_clients_are_cut_while_others_are_served(process: ServerProcess) -> None:
    base = process.base_url
    endless_head = request_head("GET", "/v1/models", {**AUTH, "X-Pad": "a" * 2000})
    completions = {**AUTH, "Content-Type": "application/json", "Content-Length": "1000"}
    stalled_body = request_head("POST", "/v1/completions", completions) + b'{"prompt": '
    with_body = {**AUTH, "Content-Length": "100000"}
    kept_alive = request_head("GET", "/v1/models", AUTH)

    def idle() -> tuple[float, bytes]:
        return hold(connect(base))

    def header_drip() -> tuple[float, bytes]:
        return hold(connect(base), drip=endless_head)

    def body_stall() -> tuple[float, bytes]:
        sock = connect(base)
        sock.sendall(stalled_body)
        return hold(sock)

    def body_drip() -> tuple[float, bytes]:
        sock = connect(base)
        sock.sendall(request_head("POST", "/v1/completions", completions))
        return hold(sock, drip=b" " * 1000)

    def keep_alive_idle() -> tuple[float, bytes]:
        sock = connect(base)
        sock.sendall(kept_alive)
        return hold(sock)

    def next_request_drip() -> tuple[float, bytes]:
        """One request served, then the next one's headers a byte at a time."""
        sock = connect(base)
        sock.sendall(kept_alive)
        return hold(sock, drip=endless_head)

    def unread_body_drip() -> tuple[float, bytes]:
        """A GET answered without reading its body; the client goes on trickling it."""
        sock = connect(base)
        sock.sendall(request_head("GET", "/v1/models", with_body) + b"x" * 10)
        return hold(sock, drip=b"x" * 1000)

    clients = {
        "idle": (idle, HEADER_S, 10),
        "header drip": (header_drip, HEADER_S, 3),
        "body stall": (body_stall, BODY_S, 2),
        "body drip": (body_drip, BODY_S, 2),
        "keep-alive idle": (keep_alive_idle, KEEP_ALIVE_S, 2),
        "next request drip": (next_request_drip, HEADER_S, 2),
        "unread body drip": (unread_body_drip, 0.0, 2),
    }
    served: list[float] = []
    with ThreadPoolExecutor(max_workers=24) as pool:
        futures = {
            name: [pool.submit(fn) for _ in range(count)]
            for name, (fn, _, count) in clients.items()
        }
        with httpx.Client(base_url=base, headers=AUTH, timeout=30) as client:
            while not all(f.done() for fs in futures.values() for f in fs):
                started = time.monotonic()
                assert client.get("/v1/models").status_code == 200
                body = {"prompt": "Hi", "max_tokens": 2}
                assert client.post("/v1/completions", json=body).status_code == 200
                served.append(time.monotonic() - started)
        results = {name: [f.result() for f in fs] for name, fs in futures.items()}
    assert len(served) >= 3 and max(served) < 10, served
    for name, (_, deadline_s, _) in clients.items():
        for cut_after, _ in results[name]:
            assert 0.8 * deadline_s <= cut_after < deadline_s + SLACK_S, (name, cut_after)
    for _, response in results["body stall"]:
        assert status_of(response) == 408 and b'"code": "request_timeout"' in response
    for name in ("keep-alive idle", "next request drip", "unread body drip"):
        for _, response in results[name]:
            assert status_of(response) == 200 and response.count(b"HTTP/1.1 ") == 1
    for _, response in results["idle"] + results["header drip"]:
        assert response == b""


# ---- 8a: the API key is checked before the body is read ------------------------------------


def test_a_wrong_key_is_refused_before_the_body_is_read(locked: LiveServer) -> None:
    """A client without the key declares a body and sends ten bytes of it: 401 at once,
    then the server hangs up (it neither waits for the body nor reads it)."""
    for declared in ("500000", str(10**12)):  # under and far over max_request_bytes
        sock = connect(locked.base_url)
        head = {"Content-Type": "application/json", "Content-Length": declared}
        sock.sendall(request_head("POST", "/v1/completions", head) + b'{"prompt":')
        took, response = hold(sock, limit_s=BODY_S + SLACK_S)
        assert status_of(response) == 401, response
        assert b"connection: close" in response.lower()
        assert took < BODY_S, f"the 401 waited {took:.1f} s: for the body deadline"


def test_a_body_that_stalls_gets_408(locked: LiveServer) -> None:
    sock = connect(locked.base_url)
    head = {**AUTH, "Content-Type": "application/json", "Content-Length": "100"}
    sock.sendall(request_head("POST", "/v1/chat/completions", head) + b"{")
    took, response = hold(sock, limit_s=BODY_S + SLACK_S)
    assert status_of(response) == 408
    assert b'"param": "body"' in response and b"body_read_timeout" in response
    assert took >= 0.8 * BODY_S


# ---- 8b: a stream the client cuts is logged as 499 -----------------------------------------


@contextlib.contextmanager
def access_records() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    lock = threading.Lock()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            with lock:
                records.append(record)

    access = logging.getLogger("server.access")
    handler, level = Keep(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        yield records
    finally:
        access.removeHandler(handler)
        access.setLevel(level)


def wait_for_record(records: list[logging.LogRecord], request_id: str) -> logging.LogRecord:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [r for r in records if getattr(r, "request_id", None) == request_id]
        if found:
            assert len(found) == 1
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no access log line for {request_id}")


def test_streams_cut_by_the_client_are_logged_499(locked: LiveServer) -> None:
    body = {"prompt": "Go on", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with access_records() as records, httpx.Client(headers=AUTH, timeout=30) as client:
        for path in ("/completions", "/chat/completions"):
            payload = dict(body)
            if path == "/chat/completions":
                payload = {**body, "messages": [{"role": "user", "content": "Go on"}]}
                del payload["prompt"]
            cut_id, whole_id = f"cut{len(path)}", f"whole{len(path)}"
            headers = {"X-Request-Id": cut_id}
            with client.stream("POST", locked.v1 + path, json=payload, headers=headers) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # hang up after the first event
            short = {**payload, "max_tokens": 2}
            whole = client.post(locked.v1 + path, json=short, headers={"X-Request-Id": whole_id})
            assert whole.text.endswith("data: [DONE]\n\n")
            assert wait_for_record(records, cut_id).status == 499
            assert wait_for_record(records, whole_id).status == 200


# ---- 8c: the OpenAPI schema says what the server sends --------------------------------------


def test_openapi_documents_the_real_responses(locked: LiveServer) -> None:
    assert httpx.get(locked.base_url + "/openapi.json", timeout=10).status_code == 401
    schema = httpx.get(locked.base_url + "/openapi.json", headers=AUTH, timeout=10).json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == ref, status
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "404" in schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearerAuth": []}]
    assert "503" in schema["paths"]["/ready"]["get"]["responses"]


# ---- config ----------------------------------------------------------------------------------


def test_timeout_flags_and_variables() -> None:
    from server.config import ServerConfig, parse_config

    defaults = ServerConfig()
    assert (defaults.timeout_keep_alive, defaults.header_read_timeout) == (5.0, 10.0)
    assert defaults.body_read_timeout == 30.0
    config = parse_config(["--header-read-timeout", "2.5"], {"LLM_SERVER_BODY_READ_TIMEOUT": "7"})
    assert (config.header_read_timeout, config.body_read_timeout) == (2.5, 7.0)
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="timeout_keep_alive must be > 0"):
            parse_config(["--timeout-keep-alive", bad], {})


# ---- static analysis -------------------------------------------------------------------------

# (file, bandit test id) of each medium-or-high finding docs/SECURITY.md justifies
ACCEPTED_FINDINGS = {
    ("server/config.py", "B104"),  # default host 0.0.0.0: a container listens on its pod address
    ("tokenization/tokenizer.py", "B615"),  # from_pretrained of a local folder, offline
    ("engine/gguf_folder.py", "B615"),  # a local GGUF's tokenizer, offline
}


def test_bandit_finds_nothing_new() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bandit", "-r", "server", "engine", "tokenization", "-q",
         "--severity-level", "medium", "-f", "json"],
        cwd=str(REPO_ROOT), capture_output=True, timeout=240,
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert report["errors"] == []
    found = {(r["filename"], r["test_id"]): r for r in report["results"]}
    new = [
        f"{r['filename']}:{r['line_number']} {r['test_id']} {r['issue_text']}"
        for key, r in found.items()
        if key not in ACCEPTED_FINDINGS
    ]
    assert not new, "new bandit findings (fix them, or justify them in docs/SECURITY.md):\n" + (
        "\n".join(new)
    )
