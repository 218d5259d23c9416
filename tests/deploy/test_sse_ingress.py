"""SSE through a real nginx configured like our Ingress: tokens arrive spread over time.

A real `python -m server` (on a tiny random checkpoint with a long context, written under
tmp_path, so one greedy completion streams ~1500 tokens over a second or so) streams a completion
through nginx three ways, each behind a controller that gzips text/event-stream (ingress-nginx's
cluster-wide `use-gzip`; nginx compresses a buffered response until the upstream ends, which is
how the clumps users report arise):
- with the Ingress's own settings (translated from the rendered annotations): spread out;
- with proxy buffering on and the server's X-Accel-Buffering header ignored: one clump at the
  end, which shows this test can fail;
- with proxy buffering on but the header honoured: spread again, so the server's
  `X-Accel-Buffering: no` alone protects a stream behind a buffering proxy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.deploy.ingress_nginx import (
    directives_from_annotations,
    free_port,
    running_nginx,
    stop_process,
)
from tests.deploy.manifests import Manifest, find, server_container

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny"
MAX_TOKENS = 1500
MAX_MODEL_LEN = 2048
PING_INTERVAL_S = 0.25
SERVER_START_TIMEOUT_S = 240.0
# What an ingress-nginx ConfigMap with use-gzip: "true" and gzip-types covering
# text/event-stream adds to every location: the worst case for streaming.
CLUSTER_GZIP = ["gzip on;", "gzip_types text/event-stream;", "gzip_min_length 0;"]


@dataclass(frozen=True)
class StreamTiming:
    """When each part of one streamed completion reached the client (monotonic seconds)."""

    started: float
    event_times: tuple[float, ...]  # each `data:` event before [DONE]
    read_times: tuple[float, ...]  # each socket read that carried bytes
    pings: int
    done: bool
    headers: httpx.Headers

    @property
    def total_s(self) -> float:
        return self.event_times[-1] - self.started

    @property
    def first_s(self) -> float:
        return self.event_times[0] - self.started

    @property
    def spread_s(self) -> float:
        return self.event_times[-1] - self.event_times[0]

    def __str__(self) -> str:
        return (
            f"{len(self.event_times)} events in {len(self.read_times)} reads: first after "
            f"{self.first_s:.3f} s, last after {self.total_s:.3f} s, {self.pings} pings"
        )


def stream_completion(base_url: str) -> StreamTiming:
    payload = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[float] = []
    reads: list[float] = []
    pings = 0
    done = False
    buffer = b""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        started = time.monotonic()
        with client.stream("POST", "/v1/completions", json=payload) as response:
            assert response.status_code == 200, response.read()
            for chunk in response.iter_bytes():
                now = time.monotonic()
                reads.append(now)
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.splitlines():
                        if line.startswith(b":"):
                            pings += 1
                        elif line == b"data: [DONE]":
                            done = True
                        elif line.startswith(b"data: "):
                            assert "error" not in json.loads(line[6:]), line
                            events.append(now)
            headers = response.headers
    assert len(events) >= MAX_TOKENS // 2, f"only {len(events)} events streamed"
    timing = StreamTiming(started, tuple(events), tuple(reads), pings, done, headers)
    print(f"{base_url}: {timing}")  # shown with -s or on failure
    return timing


def assert_spread(timing: StreamTiming) -> None:
    """Tokens arrive as they are made: the first long before the last, in many reads."""
    assert timing.done
    assert timing.total_s >= 0.3, f"stream too fast ({timing.total_s:.3f} s) to judge"
    assert timing.first_s < 0.25 * timing.total_s, str(timing)
    assert timing.spread_s > 0.5 * timing.total_s, str(timing)
    assert len(timing.read_times) >= 10, str(timing)


def assert_clumped(timing: StreamTiming) -> None:
    """All tokens arrive together at the end, as behind a buffering proxy."""
    assert timing.done
    assert timing.first_s > 0.75 * timing.total_s, str(timing)
    assert timing.spread_s < 0.25 * timing.total_s, str(timing)


@pytest.fixture(scope="module")
def server_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real `python -m server` on a tiny checkpoint, on a free loopback port."""
    from engine.tiny import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("server")
    model = write_tiny_checkpoint(
        folder / "model", arch="llama", seed=0, max_position_embeddings=MAX_MODEL_LEN
    )
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "server",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--model={model}",
        f"--cache-dir={folder / 'cache'}",
        f"--served-model-name={MODEL_NAME}",
        "--max-num-seqs=2",
        f"--max-model-len={MAX_MODEL_LEN}",
        f"--sse-ping-interval={PING_INTERVAL_S}",
        "--drain-timeout=5",
        "--log-format=text",
    ]
    log = folder / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=Path(__file__).resolve().parents[2], stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not ready after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()}"
                )
            time.sleep(0.2)
        yield port
    finally:
        stop_process(process, 30)


def _ingress_location(rendered: dict[str, list[Manifest]]) -> list[str]:
    annotations = find(rendered["cpu"], "Ingress")["metadata"]["annotations"]
    return [*directives_from_annotations(annotations), *CLUSTER_GZIP]


def _with(location: list[str], directive: str, value: str) -> list[str]:
    """The same location with one directive's value replaced."""
    replaced = [
        f"{directive} {value};" if line.startswith(directive + " ") else line for line in location
    ]
    assert replaced != location, f"{directive} is not in the location block"
    return replaced


def test_unknown_ingress_annotation_is_refused() -> None:
    with pytest.raises(ValueError, match="configuration-snippet"):
        directives_from_annotations(
            {"nginx.ingress.kubernetes.io/configuration-snippet": "more_set_headers 'A: b';"}
        )


def test_probe_paths_answer_on_the_real_server(
    server_port: int, rendered: dict[str, list[Manifest]]
) -> None:
    """Every probe path in the Deployment is a live route that answers 200 once warm."""
    container = server_container(rendered["cpu"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        response = httpx.get(f"http://127.0.0.1:{server_port}{path}", timeout=5)
        assert response.status_code == 200, (probe, path, response.text)


def test_autoscaler_metric_is_exported(
    server_port: int, rendered: dict[str, list[Manifest]]
) -> None:
    hpa = find(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]
    names = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    text = httpx.get(f"http://127.0.0.1:{server_port}/metrics", timeout=5).text
    for name in names:
        assert any(
            line.startswith(name + "{") or line.startswith(name + " ") for line in text.splitlines()
        ), f"/metrics has no {name}"


def test_stream_headers_from_the_server(server_port: int) -> None:
    timing = stream_completion(f"http://127.0.0.1:{server_port}")
    assert timing.headers["x-accel-buffering"] == "no"
    assert timing.headers["cache-control"] == "no-cache"
    assert timing.headers["content-type"].startswith("text/event-stream")
    assert_spread(timing)
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    url = f"http://127.0.0.1:{server_port}/v1/chat/completions"
    with httpx.stream("POST", url, json=chat, timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["cache-control"] == "no-cache"
        assert response.read().rstrip().endswith(b"data: [DONE]")


def test_stream_through_ingress_settings_is_spread(
    server_port: int, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    location = _ingress_location(rendered)
    with running_nginx(tmp_path, server_port, location) as port:
        timing = stream_completion(f"http://127.0.0.1:{port}")
    assert timing.headers["cache-control"] == "no-cache"
    assert timing.headers["content-type"].startswith("text/event-stream")
    # Keep-alive comments pass the proxy too (they keep idle streams under the read timeout).
    assert timing.pings >= 1
    assert_spread(timing)


def test_stream_through_buffering_proxy_clumps(
    server_port: int, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    location = _with(_ingress_location(rendered), "proxy_buffering", "on")
    location.append("proxy_ignore_headers X-Accel-Buffering;")
    with running_nginx(tmp_path, server_port, location) as port:
        timing = stream_completion(f"http://127.0.0.1:{port}")
    assert_clumped(timing)


def test_accel_buffering_header_protects_stream_behind_buffering_proxy(
    server_port: int, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    location = _with(_ingress_location(rendered), "proxy_buffering", "on")
    with running_nginx(tmp_path, server_port, location) as port:
        timing = stream_completion(f"http://127.0.0.1:{port}")
    assert_spread(timing)
