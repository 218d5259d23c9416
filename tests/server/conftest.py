"""One real server (uvicorn on a thread, tiny JAX model) shared by the HTTP tests of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import LiveServer, make_config, serve_in_thread


@pytest.fixture(scope="session")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve_in_thread(make_config(tiny_checkpoint)) as server:
        yield server
