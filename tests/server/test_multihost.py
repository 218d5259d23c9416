"""Two `python -m server` processes on loopback, two CPU devices each, as one server.

Process 0 serves HTTP; its engine core process leads, and process 1 runs every step the
core runs (engine.multihost); the model is sharded over all four devices (tensor parallel
4, gloo collectives between the processes). Together they must give the greedy and the
seeded text the one-process server (the `live` fixture: one device) gives, prompt
logprobs included; SIGTERM, sent to both as Kubernetes does, drains a stream in flight
and both exit 0; a process that cannot reach process 0 is a clear error within the
timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.harness import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPO_ROOT,
    LiveServer,
    free_port,
    wait_ready,
)

pytestmark = pytest.mark.slow

# one step shape (8 tokens, 2 sequences): process 1 compiles every program at each start
# (JAX keeps compiled programs on disk from process 0 only)
SHAPES = [
    "--max-slots", "2", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens",
    "8", "--page-size", "8", "--served-model-name", MODEL_NAME, "--log-level", "info",
]  # fmt: skip
PROMPTS = ("Two hosts, one model", "and a longer prompt " * 5)  # 14 and 48 tokens: chunks of 8


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "server", *args],
            cwd=str(REPO_ROOT),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def free_pair() -> int:
    """A port whose next one is free too (the command channel's)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def completion(client: openai.OpenAI, **kw: Any) -> Any:
    body = {"model": MODEL_NAME, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    return client.completions.create(**(body | kw)).choices[0]  # type: ignore[call-overload]


def test_two_processes_serve_as_one(
    tiny_checkpoint: Path, tmp_path: Path, live: LiveServer
) -> None:
    coordinator = f"127.0.0.1:{free_pair()}"
    http_port = free_port()
    common = ["--model", str(tiny_checkpoint), *SHAPES, "--tensor-parallel-size", "4"]
    common += ["--coordinator-address", coordinator, "--num-processes", "2"]
    common += ["--distributed-timeout", "120", "--drain-timeout", "30"]
    follower = start([*common, "--process-id", "1"], tmp_path / "p1.log")
    leader = start(
        [*common, "--process-id", "0", "--host", "127.0.0.1", "--port", str(http_port)],
        tmp_path / "p0.log",
    )
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_ready(base, 300, leader)
        two = openai.OpenAI(base_url=base + "/v1", api_key="none")
        one = openai.OpenAI(base_url=live.v1, api_key="none")
        for prompt in PROMPTS:
            got, want = (completion(c, prompt=prompt, temperature=0) for c in (two, one))
            assert got.text == want.text and got.text
        seeded = {"prompt": PROMPTS[0], "temperature": 1.0, "seed": 7, "max_tokens": 12}
        got, want = (completion(c, **seeded) for c in (two, one))
        assert got.text == want.text
        asked = {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": 2}
        asked["extra_body"] = {"prompt_logprobs": 2, "ignore_eos": True}
        got, want = (completion(c, **asked).model_extra["prompt_logprobs"] for c in (two, one))
        assert len(got) == len(want) > 30 and got[0] is None
        for mine, theirs in zip(got[1:], want[1:], strict=True):
            assert mine.keys() == theirs.keys()  # the same prompt token and best two
            for token, entry in mine.items():
                assert entry["logprob"] == pytest.approx(theirs[token]["logprob"], abs=1e-4)

        # SIGTERM to both with a stream open: it finishes whole, then both exit 0
        stream = two.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        for proc in (follower, leader):
            proc.send_signal(signal.SIGTERM)
        pieces += [chunk.choices[0].text for chunk in chunks if chunk.choices]
        whole = completion(one, prompt=PROMPTS[0], temperature=0, max_tokens=48).text
        assert "".join(pieces) == whole
        assert leader.wait(60) == 0
        assert follower.wait(60) == 0
    finally:
        for proc in (leader, follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    follower_log = (tmp_path / "p1.log").read_text(errors="replace")
    assert "SIGTERM: following on" in follower_log
    assert "process 0 stopped: following ends" in follower_log
    leader_log = (tmp_path / "p0.log").read_text(errors="replace")
    assert "4 cpu device(s)" in leader_log  # the core's mesh spans both processes
    records = [json.loads(line) for line in leader_log.splitlines() if line.startswith("{")]
    assert [r["inflight"] for r in records if r["message"] == "draining"] == [1]


def test_a_process_that_cannot_reach_process_0_fails_clearly(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    nobody = f"127.0.0.1:{free_pair()}"
    args = ["--model", str(tiny_checkpoint), "--coordinator-address", nobody]
    args += ["--num-processes", "2", "--process-id", "1", "--distributed-timeout", "2"]
    started = time.monotonic()
    proc = start(args, tmp_path / "p1.log")
    assert proc.wait(60) == 1
    assert time.monotonic() - started < 30
    log = (tmp_path / "p1.log").read_text(errors="replace")
    assert "could not reach process 0" in log and "within 2 s" in log
