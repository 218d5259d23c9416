"""`python -m server` as a process: readiness, API key, SIGTERM drain, engine fault, demo model.

Every process uses the shapes of the in-thread test server, so the persistent
compile cache makes each warm-up a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPO_ROOT,
    SLOTS,
    free_port,
    pip_without_index,
    serve_process,
    sse_events,
)

pytestmark = pytest.mark.slow

SHAPE_FLAGS = [
    "--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_MODEL_LEN),
    "--served-model-name", MODEL_NAME, "--log-level", "info",
]  # fmt: skip
KEY = "s3cret-key"


def test_probes_api_key_and_sigterm_drain(tiny_checkpoint: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    env = {"PYTHONPATH": str(REPO_ROOT), "LLM_SERVER_API_KEY": KEY}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--model", str(tiny_checkpoint), "--host",
             "127.0.0.1", "--port", str(port), "--drain-timeout", "30", *SHAPE_FLAGS],
            cwd=str(REPO_ROOT), env={**_environ(), **env}, stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # readiness and health: 503 while loading and warming up, then 200 (health as a
        # vLLM server's, which answers nothing until its engine is up)
        ready_codes, health_codes = _poll_until_ready(base, proc)
        assert 503 in ready_codes and ready_codes[-1] == 200
        assert 503 in health_codes and health_codes == sorted(health_codes, reverse=True)
        _check_api_key(base)
        _check_sigterm_drain(base, proc)
    finally:
        _reap(proc)
    log = log_path.read_text(errors="replace")
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    access = [r for r in records if r.get("message") == "request" and r.get("status") == 200]
    assert any(r.get("completion_tokens") for r in access), "access log lines carry token counts"
    assert all("request_id" in r for r in access)
    frozen = [r for r in records if r.get("message") == "startup heap frozen"]
    assert len(frozen) == 1 and frozen[0]["objects"] > 10_000, frozen  # once, when ready
    core = [r["message"] for r in records if "engine core: startup heap frozen" in r["message"]]
    assert len(core) == 1 and int(core[0].split("(")[1].split()[0]) > 10_000, core


def _reap(proc: subprocess.Popen) -> None:
    """Kill a server a failed test left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def _poll_until_ready(base: str, proc: subprocess.Popen) -> tuple[list[int], list[int]]:
    ready_codes: list[int] = []
    health_codes: list[int] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            health_codes.append(httpx.get(base + "/health", timeout=2).status_code)
            ready = httpx.get(base + "/ready", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        ready_codes.append(ready)
        if ready == 200:
            return ready_codes, health_codes
        time.sleep(0.05)
    raise TimeoutError("server not ready")


def _check_api_key(base: str) -> None:
    routes = [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{MODEL_NAME}", None),
        ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 2}),
    ]  # fmt: skip
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {KEY}"}
        response = httpx.request(method, base + path, json=body, headers=good, timeout=30)
        assert response.status_code == 200, (path, response.text)
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(base + path, timeout=10).status_code == 200


def _check_sigterm_drain(base: str, proc: subprocess.Popen) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Drain me", "max_tokens": 90, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
    expected_text = expected.json()["choices"][0]["text"]
    streams = 4 * SLOTS

    async def run() -> tuple[list[bytes], int]:
        async with httpx.AsyncClient(timeout=60, headers=headers) as client:
            started = asyncio.Event()
            opened = 0

            async def one() -> bytes:
                nonlocal opened
                async with client.stream(
                    "POST", base + "/v1/completions", json={**body, "stream": True}
                ) as response:
                    assert response.status_code == 200
                    opened += 1
                    if opened == streams:
                        started.set()
                    return await response.aread()

            tasks = [asyncio.create_task(one()) for _ in range(streams)]
            await started.wait()
            proc.send_signal(signal.SIGTERM)
            status = 0
            for _ in range(20):  # the signal lands within moments; from then on: 503
                await asyncio.sleep(0.02)
                short = {**body, "max_tokens": 1}
                status = (await client.post(base + "/v1/completions", json=short)).status_code
                if status == 503:
                    break
            return await asyncio.gather(*tasks), status

    raws, refused_status = asyncio.run(run())
    assert refused_status == 503
    for raw in raws:
        events = sse_events(raw.decode("utf-8"))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0


def test_engine_fault_fails_requests_and_exits_nonzero(tmp_path: Path) -> None:
    """Also: no --model where the package index cannot be reached serves the embedded demo
    model, built on first start, and one log line says why."""
    cache = tmp_path / "cache"
    env = {
        "LLM_SERVER_FAULT_INJECTION": "generate:after=60",
        "LLM_SERVER_CACHE_DIR": str(cache),
        **pip_without_index(tmp_path),
    }
    with serve_process(SHAPE_FLAGS, tmp_path, env=env) as server:
        assert (cache / "demo-model" / "config.json").is_file()
        lines = server.log().splitlines()
        fallback = [line for line in lines if "cannot fetch the default model" in line]
        assert len(fallback) == 1 and "serving the random demo checkpoint" in fallback[0]
        base = server.base_url
        models = httpx.get(base + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == MODEL_NAME
        ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200

        body = {"prompt": "Fail", "max_tokens": 120, "ignore_eos": True}

        async def run() -> tuple[httpx.Response, bytes, float]:
            """A stream is running when a whole request joins it; the fault hits both."""
            async with httpx.AsyncClient(timeout=30) as client:
                started = time.monotonic()
                raw = b""
                whole_task = None
                async with client.stream(
                    "POST", base + "/v1/completions", json={**body, "stream": True}
                ) as response:
                    async for piece in response.aiter_bytes():
                        raw += piece
                        if whole_task is None:  # the stream is running: a second request joins
                            whole_task = asyncio.create_task(
                                client.post(base + "/v1/completions", json=body)
                            )
                assert whole_task is not None
                whole = await whole_task
                return whole, raw, time.monotonic() - started

        whole, raw, elapsed = asyncio.run(run())
        assert elapsed < 5
        assert whole.status_code == 503
        # failed in flight, or refused when it arrived after the fault: an error either way
        assert whole.json()["error"]["code"] in ("engine_failure", "unavailable")
        events = sse_events(raw.decode("utf-8"))
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2])
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 503
        assert httpx.get(base + "/ready", timeout=5).status_code == 503
        assert server.proc.wait(30) != 0
        log = server.log()
        assert log.count('"traceback"') == 1, "the stage's traceback is logged exactly once"
        assert "InjectedFault" in log


def test_bad_flag_exits_with_usage_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "server", "--port", "not-a-port"],
        cwd=str(REPO_ROOT),
        env={**_environ(), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert b"--port" in result.stderr


def test_sigterm_during_warm_up_drains_and_exits_zero(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A pod stopped while it still compiles: the signal is handled and the exit is clean.

    The signal goes out as soon as the engine is built, and a cold compile cache keeps the
    warm-up compiling for many seconds after that; a lost signal, an exit by the signal
    itself, or a C++ abort under a compiling loader thread all fail here.
    """
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--model", str(tiny_checkpoint), "--host",
             "127.0.0.1", "--port", str(free_port()), "--log-format", "text"],
            cwd=str(REPO_ROOT), env={**_environ(), "PYTHONPATH": str(REPO_ROOT),
                                     "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cold")},
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "engine core:" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, "server exited during start-up"
            assert time.monotonic() < deadline, "the engine was never built"
            time.sleep(0.05)
        time.sleep(1.0)  # into the compiles of the default shapes (8 slots, buckets to 256)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        _reap(proc)
    log = log_path.read_text(errors="replace")
    assert code == 0, f"exit code {code}; log tail:\n{log[-2000:]}"
    assert "signal received: draining" in log


def test_second_sigterm_exits_at_once_instead_of_draining(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The first SIGTERM starts a drain that would take many seconds (32 queued requests of
    16 samples on 4 slots); a second one ends the process at once with exit code 1, cutting
    the streams, instead of finishing them and exiting 0."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--model", str(tiny_checkpoint), "--host",
             "127.0.0.1", "--port", str(port), "--drain-timeout", "300",
             "--max-queued-samples", "512", *SHAPE_FLAGS],
            cwd=str(REPO_ROOT), env={**_environ(), "PYTHONPATH": str(REPO_ROOT)},
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    body = {"prompt": "Long", "max_tokens": 100, "n": 16, "ignore_eos": True, "stream": True}
    streams = 32

    async def run() -> tuple[list[str], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            opened = asyncio.Event()
            count = 0

            async def one() -> str:
                nonlocal count
                try:
                    async with client.stream("POST", base + "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        count += 1
                        if count == streams:
                            opened.set()
                        raw = await r.aread()
                except httpx.HTTPError:
                    return "cut"
                return "done" if sse_events(raw.decode("utf-8"))[-1] == "[DONE]" else "cut"

            tasks = [asyncio.create_task(one()) for _ in range(streams)]
            await asyncio.wait_for(opened.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            for _ in range(100):  # the drain has begun once readiness says 503
                if (await client.get(base + "/ready")).status_code == 503:
                    break
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            second = time.monotonic()
            outcomes = await asyncio.gather(*tasks)
            return outcomes, second

    try:
        _poll_until_ready(base, proc)
        outcomes, second = asyncio.run(run())
        code = proc.wait(60)
        exited_after = time.monotonic() - second
    finally:
        _reap(proc)
    log = log_path.read_text(errors="replace")
    assert code == 1, f"exit code {code}; log tail:\n{log[-2000:]}"
    assert "second signal: exiting now" in log
    assert "cut" in outcomes, "every stream finished: the second signal waited for the drain"
    assert exited_after < 30
