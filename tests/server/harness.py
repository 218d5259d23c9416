"""Real servers for the HTTP tests: uvicorn in-process on a thread, or `python -m server`.

Both listen on 127.0.0.1 on a free port; nothing is mocked between the
client socket and the JAX engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from server.app import create_app
from server.backend import Backend
from server.config import ServerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

MODEL_NAME = "tiny-test"
SLOTS = 4
MAX_MODEL_LEN = 128


def make_config(model: Path, **overrides: object) -> ServerConfig:
    base = {
        "model": model,
        "served_model_name": MODEL_NAME,
        "max_num_seqs": SLOTS,
        "max_model_len": MAX_MODEL_LEN,
        "max_queued_samples": 64,
        "sse_ping_interval": 0.5,
    }
    base.update(overrides)
    return ServerConfig(**base)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    config: ServerConfig
    app: object

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


def wait_ready(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/ready", timeout=2).status_code == 200:
                return
            health = httpx.get(base_url + "/health", timeout=2)
            if health.status_code == 503 and health.json()["status"] == "failed":
                raise RuntimeError(f"server at {base_url} failed while starting")
        time.sleep(0.1)
    raise TimeoutError(f"server at {base_url} not ready after {timeout} s")


@contextlib.contextmanager
def serve_in_thread(
    config: ServerConfig,
    ready_timeout: float = 180,
    loader: Callable[[], Backend] | None = None,
    wait: bool = True,
) -> Iterator[LiveServer]:
    """uvicorn on a background thread (no signal handlers there), stopped on exit.

    With wait=False it yields once the socket listens, before the model is ready.
    """
    port = free_port()
    config = _with_port(config, port)
    app = create_app(config, loader)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_ready(base, ready_timeout)
        else:
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.02)
        yield LiveServer(base, config, app)
    finally:
        server.should_exit = True
        thread.join(15)


def _with_port(config: ServerConfig, port: int) -> ServerConfig:
    from dataclasses import replace

    return replace(config, host="127.0.0.1", port=port)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


@contextlib.contextmanager
def serve_process(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None, ready_timeout: float = 180
) -> Iterator[ServerProcess]:
    """`python -m server` as a child process; killed on exit if still running."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=str(REPO_ROOT),
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    handle = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(handle.base_url, ready_timeout, proc)
        yield handle
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def pip_without_index(tmp_path: Path) -> dict[str, str]:
    """Environment under which pip reaches no package index and reads no configuration:
    the default model cannot be fetched (an offline first start)."""
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    return {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(empty),
    }


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert "\r" not in raw, "SSE lines must end with \\n only"
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        comments = [line for line in lines if line.startswith(":")]
        assert len(data) + len(comments) == len(lines), f"unexpected SSE lines: {lines!r}"
        if data:
            assert len(data) == 1, f"one data line per event expected: {block!r}"
            events.append(data[0])
    assert raw.endswith("\n\n"), "the stream must end with a blank line"
    return events


def pick_stop(text: str, length: int) -> str:
    """A stop string from the middle of `text`: no U+FFFD, not blank, so a match is plain."""
    for start in [*range(len(text) // 2, len(text) - length), *range(1, len(text) // 2)]:
        window = text[start : start + length]
        if len(window) == length and "\ufffd" not in window and window.strip():
            return window
    raise AssertionError(f"no usable stop string of {length} characters in {text!r}")


def completion_texts(
    server: LiveServer, prompts: list[str], max_tokens: int, **extra: object
) -> list[str]:
    """Each prompt's completion texts (every choice, in order) from the openai SDK, asked
    whole and streamed; the two must agree."""
    from openai import OpenAI  # only the HTTP tests need the SDK

    client = OpenAI(base_url=server.v1, api_key="unused")
    out: list[str] = []
    for prompt in prompts:
        whole = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, **extra
        )
        chunks = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, stream=True, **extra
        )
        streamed = [""] * len(whole.choices)
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == [c.text for c in whole.choices]
        out += streamed
    return out
