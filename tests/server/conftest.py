"""One real server (uvicorn on a thread, tiny JAX model) shared by the HTTP tests of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.config import ServerConfig
from tests.server.harness import LiveServer, serve_in_thread

MODEL_NAME = "tiny-test"
SLOTS = 4
MAX_MODEL_LEN = 128


def make_config(model: Path, **overrides: object) -> ServerConfig:
    base = {
        "model": model,
        "served_model_name": MODEL_NAME,
        "max_slots": SLOTS,
        "max_model_len": MAX_MODEL_LEN,
        "prefill_buckets": (32, 64),
        "max_queued_requests": 32,
        "sse_ping_interval": 0.5,
    }
    base.update(overrides)
    return ServerConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve_in_thread(make_config(tiny_checkpoint)) as server:
        yield server
