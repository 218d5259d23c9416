"""The HTTP routes, one APIRouter per endpoint family, each handler importable by name.

Owns: `Served`, what every handler reads (the config, the runtime, the metrics, the
tokenizer pool), kept on `app.state.served` by server.app and handed to a handler by
`served` (a FastAPI dependency). Families: server.routes.probes (health, readiness,
version), .models (/v1/models), .generate (completions, chat, responses and stored
responses, SageMaker's /invocations), .tokens (vLLM's /tokenize, /detokenize, /tokenizer_info).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from server.config import ServerConfig
from server.lifecycle import Runtime
from server.lora import LoraRegistry
from server.metrics import EngineMetrics
from server.response_store import ResponseStore

T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """One app's handles; made once by server.app.create_app."""

    config: ServerConfig
    runtime: Runtime
    metrics: EngineMetrics
    # Tokenizing and chat-template rendering of a large prompt take up to a second of CPU:
    # they run here, never on the event loop, so streams and probes keep their latency.
    text_pool: ThreadPoolExecutor
    created: int  # the model card's `created` (the app's start, unix seconds)
    loras: LoraRegistry  # the LoRA adapters served (server.lora)
    responses: ResponseStore  # stored Responses API responses (server.response_store)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)


def served(request: Request) -> Served:
    """The app's Served (the dependency every handler takes)."""
    value: Served = request.app.state.served
    return value
