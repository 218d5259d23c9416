"""Hostile and careless inputs: each a fast 4xx in OpenAI's shape, never a 5xx, never a crash.

Every case here once crashed the process, answered 500, or was accepted when
the engine could not hold it (a value that overflowed its int32 or float32
conversion in the prefill stage killed every stream). After the whole table
the server is healthy and serves a normal request.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.harness import LiveServer
from tests.server.test_errors import assert_error_shape

OK = {"prompt": "Hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LONE = "\ud800"

# (case, path, JSON body, expected param or None); all expect 400
JSON_CASES = [
    ("min_tokens beyond int32", "/completions", {**OK, "min_tokens": 10**12}, "min_tokens"),
    ("min_tokens above max_tokens", "/completions", {**OK, "min_tokens": 3}, "min_tokens"),
    ("chat min_tokens beyond context", "/chat/completions", {**CHAT, "max_tokens": None,
     "min_tokens": 10**6}, "min_tokens"),
    ("top_k beyond int32", "/completions", {**OK, "top_k": 10**12}, "top_k"),
    ("top_k above the vocabulary", "/completions", {**OK, "top_k": 10**6}, "top_k"),
    ("top_k below -1", "/completions", {**OK, "top_k": -5}, "top_k"),
    ("seed beyond 64 bits", "/completions", {**OK, "seed": 2**64}, "seed"),
    ("seed below -2**63", "/completions", {**OK, "seed": -(2**63) - 1}, "seed"),
    ("temperature 1e308", "/completions", {**OK, "temperature": 1e308}, "temperature"),
    ("temperature above 2", "/completions", {**OK, "temperature": 2.5}, "temperature"),
    ("presence_penalty above 2", "/completions", {**OK, "presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty below -2", "/chat/completions", {**CHAT, "frequency_penalty": -2.5},
     "frequency_penalty"),
    ("max_tokens as a string", "/completions", {**OK, "max_tokens": "5"}, "max_tokens"),
    ("n as a bool", "/completions", {**OK, "n": True}, "n"),
    ("logprobs as a bool", "/completions", {**OK, "logprobs": False}, "logprobs"),
    ("temperature as a string", "/completions", {**OK, "temperature": "0.5"}, "temperature"),
    ("seed as a float", "/completions", {**OK, "seed": 1.5}, "seed"),
    ("prompt ids as strings of digits", "/completions", {"prompt": [[1, "2"]]}, "prompt"),
    ("n = 1000", "/completions", {**OK, "n": 1000}, "n"),
    ("64 prompts x n=16", "/completions", {"prompt": ["a"] * 64, "n": 16, "max_tokens": 1}, "n"),
    ("10,000 stop strings", "/completions", {**OK, "stop": ["x"] * 10_000}, "stop"),
    ("token id out of range", "/completions", {"prompt": [1, 2**40]}, "prompt"),
    ("negative token id", "/completions", {"prompt": [-1]}, "prompt"),
    ("stop_token_ids out of range", "/completions", {**OK, "stop_token_ids": [2**40]},
     "stop_token_ids"),
    ("lone surrogate in prompt", "/completions", {**OK, "prompt": "a" + LONE}, None),
    ("lone surrogate in a prompt list", "/completions", {**OK, "prompt": ["ok", LONE]}, None),
    ("lone surrogate in chat content", "/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": LONE}]}, None),
    ("lone surrogate in a chat text part", "/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     None),
    ("lone surrogate in model", "/completions", {**OK, "model": LONE}, None),
    ("lone surrogate in a key", "/completions", {**OK, LONE: 1}, None),
    ("lone low surrogate in stop", "/completions", {**OK, "stop": ["\udc00"]}, None),
]  # fmt: skip

# (case, path, raw body bytes); all expect 400
RAW_CASES = [
    ("Infinity literal", "/completions", b'{"prompt": "Hi", "temperature": Infinity}'),
    ("-Infinity literal", "/completions", b'{"prompt": "Hi", "top_p": -Infinity}'),
    ("NaN literal", "/completions", b'{"prompt": "Hi", "temperature": NaN}'),
    ("overflowing number 1e999", "/completions", b'{"prompt": "Hi", "temperature": 1e999}'),
    ("nesting depth 100k", "/completions", b"[" * 100_000 + b"]" * 100_000),
    ("nesting depth 100k in a field", "/chat/completions",
     b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("invalid UTF-8", "/completions", b'{"prompt": "\xff\xfe bad"}'),
    ("truncated UTF-8", "/completions", b'{"prompt": "caf\xc3"}'),
    ("escaped lone surrogate", "/completions", b'{"prompt": "\\ud800"}'),
    ("escaped lone surrogate in model", "/chat/completions",
     b'{"model": "\\udfff", "messages": [{"role": "user", "content": "x"}]}'),
]  # fmt: skip

FAST_S = 10.0  # generous on a loaded 2-core machine; the failures this guards took minutes


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    ("name", "path", "body", "param"), JSON_CASES, ids=[c[0] for c in JSON_CASES]
)
def test_hostile_json_is_a_fast_400(
    live: LiveServer, name: str, path: str, body: dict, param: str | None
) -> None:
    raw = json.dumps(body).encode()  # json.dumps writes lone surrogates as \\udXXX escapes
    started = time.monotonic()
    response = httpx.post(
        live.v1 + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert time.monotonic() - started < FAST_S
    error = assert_error_shape(response, 400)
    assert response.headers.get("x-request-id")
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(("name", "path", "raw"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_hostile_raw_body_is_a_fast_400(live: LiveServer, name: str, path: str, raw: bytes) -> None:
    started = time.monotonic()
    response = httpx.post(
        live.v1 + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert time.monotonic() - started < FAST_S
    error = assert_error_shape(response, 400)
    assert error["code"] == "invalid_json", error
    assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200


def test_lone_surrogate_keeps_the_keep_alive_connection(live: LiveServer) -> None:
    """The 500 it once caused also reset the next request on the same connection."""
    bad = json.dumps({**OK, "prompt": LONE}).encode()
    with httpx.Client(timeout=30) as client:  # one pooled keep-alive connection
        for _ in range(3):
            response = client.post(
                live.v1 + "/completions", content=bad, headers={"content-type": "application/json"}
            )
            assert_error_shape(response, 400)
            ok = client.post(live.v1 + "/completions", json=OK)
            assert ok.status_code == 200, ok.text


def test_a_50_mb_body_is_refused_without_being_read(live: LiveServer) -> None:
    before = _rss_mb()
    url = urlparse(live.v1 + "/completions")
    size = 50 * 1024 * 1024
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        head = (
            f"POST {url.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "' + b"a" * 65536)
        started = time.monotonic()
        reply = b""
        while True:  # the server closes the connection after its answer
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        assert time.monotonic() - started < FAST_S
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"max_request_bytes" in reply or b"request_too_large" in reply
    assert _rss_mb() - before < 40  # the body was never buffered
    assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200


def test_the_server_serves_after_every_hostile_case(live: LiveServer) -> None:
    for _name, path, body, _ in JSON_CASES:
        httpx.post(live.v1 + path, content=json.dumps(body).encode(), timeout=30)
    for _name, path, raw in RAW_CASES:
        httpx.post(live.v1 + path, content=raw, timeout=30)
    assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200
    response = httpx.post(live.v1 + "/completions", json={**OK, "max_tokens": 4}, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
