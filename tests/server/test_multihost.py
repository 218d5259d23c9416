"""Two `python -m server` processes on loopback, two CPU devices each, as one server.

Process 0 serves HTTP and leads; process 1 only follows its engine calls; the model
is sharded over all four devices (tensor parallel 4, gloo collectives between the
processes). Together they must give the greedy text the one-process, one-device
in-thread server gives, drain on SIGTERM (sent to both, as Kubernetes does) and
exit 0; a process that cannot reach process 0 is a clear error within the timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.server.harness import MODEL_NAME, REPO_ROOT, LiveServer, free_port, wait_ready
from tests.server.test_process import SHAPE_FLAGS

pytestmark = pytest.mark.slow


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
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def test_two_processes_serve_as_one(
    tiny_checkpoint: Path, tmp_path: Path, live: LiveServer
) -> None:
    coordinator = f"127.0.0.1:{free_pair()}"
    http_port = free_port()
    common = ["--model", str(tiny_checkpoint), *SHAPE_FLAGS, "--tensor-parallel-size", "4"]
    common += ["--engine", "slot"]  # multi-host serving is the slot engine's for now
    common += ["--max-slots", "2", "--prefill-buckets", "64", "--prefill-chunk", "0"]
    common += ["--max-prefill-batch", "1"]  # few shapes: each compile spans the processes
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
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        one = openai.OpenAI(base_url=live.v1, api_key="none")
        for prompt in ("Two hosts, one model", "and a longer prompt " * 5):
            kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            extra = {"extra_body": {"ignore_eos": True}}
            got = client.completions.create(**kw, **extra).choices[0].text  # type: ignore[call-overload]
            want = one.completions.create(**kw, **extra).choices[0].text  # type: ignore[call-overload]
            assert got == want
        chunks = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "stream across hosts"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        for proc in (follower, leader):
            proc.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0
        assert follower.wait(60) == 0
    finally:
        for proc in (leader, follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    follower_log = (tmp_path / "p1.log").read_text(errors="replace")
    assert "process 0 stopped: following ends" in follower_log
    assert "SIGTERM: following on" in follower_log


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
