"""`python -m server --prefill-devices 0-1 --generate-devices 2-3` on four CPU devices.

The same server as test_process's, disaggregated: the openai SDK gets the same greedy
text as from the interleaved in-thread server, the Server-Timing header and the
stream's usage chunk show the transfer, /metrics its queue, and SIGTERM drains
open streams as in interleaved mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.harness import MODEL_NAME, REPO_ROOT, LiveServer, sse_events
from tests.server.test_metrics import scrape, value
from tests.server.test_process import (
    KEY,
    SHAPE_FLAGS,
    _check_sigterm_drain,
    _environ,
    _poll_until_ready,
    _reap,
)
from tests.server.test_timing import parse_server_timing

pytestmark = pytest.mark.slow


def test_disaggregated_server_serves_drains_and_reports_the_transfer(
    tiny_checkpoint: Path, tmp_path: Path, live: LiveServer
) -> None:
    import subprocess
    import sys

    from tests.server.harness import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**_environ(), "PYTHONPATH": str(REPO_ROOT), "LLM_SERVER_API_KEY": KEY}
    flags = ["--prefill-devices", "0-1", "--generate-devices", "2-3", "--drain-timeout", "30"]
    flags += ["--engine", "slot"]  # disaggregated serving is the slot engine's for now
    flags += ["--max-slots", "2", "--prefill-buckets", "64", "--prefill-chunk", "0"]
    flags += ["--max-prefill-batch", "1"]  # few shapes: two engines warm up
    with open(tmp_path / "server.log", "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--model", str(tiny_checkpoint), "--host",
             "127.0.0.1", "--port", str(port), *SHAPE_FLAGS, *flags],
            cwd=str(REPO_ROOT), env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _poll_until_ready(base, proc)
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY)
        interleaved = openai.OpenAI(base_url=live.v1, api_key="none")
        for prompt in ("Split the work", "a longer prompt " * 6):
            kw = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            raw = client.completions.with_raw_response.create(**kw, extra_body={"ignore_eos": True})
            want = interleaved.completions.create(**kw, extra_body={"ignore_eos": True})
            assert raw.parse().choices[0].text == want.choices[0].text
            phases = parse_server_timing(raw.headers["server-timing"])
            assert "transfer" in phases and phases["transfer"] >= 0
        body = {"model": MODEL_NAME, "prompt": "stream", "max_tokens": 4, "stream": True}
        body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers) as r:
            events = sse_events(r.read().decode())
        assert "transfer" in json.loads(events[-2])["server_timing"]
        metrics = scrape(type(live)(base, live.config, None))
        assert value(metrics, "llm_request_transfer_time_seconds_count") >= 3
        assert ("llm_queue_depth", (("model_name", MODEL_NAME), ("stage", "transfer"))) in metrics
        _check_sigterm_drain(base, proc)
    finally:
        _reap(proc)
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "disaggregated: prefill on (0, 1), generate on (2, 3)" in log
