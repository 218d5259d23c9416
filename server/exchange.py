"""One HTTP generation request from submit to its last byte.

Runs on: the event loop. Owns: the request's RequestStreams (through
`generation.feed`), its in-flight slot in the drain count, its metrics and its
log fields. `close()` is idempotent and runs however the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from engine.request import RequestFailed, RequestStream
from server.errors import APIError
from server.generation import DrainExpired, PromptDelta, feed, submit_all
from server.lifecycle import Backend, Runtime, State
from server.metrics import EngineMetrics
from server.params import GenerationPlan

T = TypeVar("T")


@dataclass
class RequestLog:
    """Fields the access log line reports for a generation request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None


class Exchange:
    """Streams, metrics and cleanup of one accepted generation request."""

    def __init__(
        self,
        runtime: Runtime,
        backend: Backend,
        plan: GenerationPlan,
        metrics: EngineMetrics,
        log: RequestLog,
    ):
        self.runtime = runtime
        self.backend = backend
        self.plan = plan
        self.metrics = metrics
        self.log = log
        self.streams: list[RequestStream] = submit_all(backend.orchestrator, plan.requests)
        runtime.acquire()
        self._closed = False
        prompt_tokens = sum(len(p.ids) for p in plan.prompts)
        log.prompt_tokens = prompt_tokens
        metrics.observe_prompt(prompt_tokens)

    async def deltas(self) -> AsyncIterator[PromptDelta]:
        """Every delta, in order per sample; records each sample's end in the metrics."""
        try:
            async for item in feed(
                self.backend.orchestrator,
                self.streams,
                self.runtime.drain_expired,
                self._stream_ended,
            ):
                delta = item.delta
                if delta.finish_reason is not None:
                    tokens = 0 if self.plan.discard_output else delta.completion_tokens
                    self.metrics.observe_sample(delta.finish_reason, tokens)
                    self.log.completion_tokens += tokens
                    self.log.finish_reasons.append(delta.finish_reason)
                yield item
        except RequestFailed as exc:
            if self.runtime.state in (State.DRAINING, State.STOPPED):
                exc = DrainExpired(str(exc))  # the drain timeout stopped the orchestrator
            self._failed(exc)
            raise exc from None
        except BaseException as exc:
            if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        self.log.error = type(exc).__name__
        self.metrics.observe_failure(type(exc).__name__)

    def _stream_ended(self, stream: RequestStream) -> None:
        self.metrics.observe_timings(stream.timings)
        ttft = stream.timings.ttft_s
        if ttft is not None and (self.log.ttft_s is None or ttft < self.log.ttft_s):
            self.log.ttft_s = ttft

    async def close(self) -> None:
        """Abort what is unfinished and leave the drain count; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for stream in self.streams:
            if not stream.finished:
                self.backend.orchestrator.abort(stream.request_id)
        self.runtime.release()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it when the client disconnects first (non-streaming)."""
    task = asyncio.ensure_future(work)
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if not disconnected:
            raise  # cancelled from outside
        raise APIError(499, "client closed the request", code="client_disconnected") from None
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


def log_of(request: Request) -> RequestLog:
    """The access-log record the logging middleware reads after the response."""
    log = getattr(request.state, "generation_log", None)
    if log is None:
        log = RequestLog()
        request.state.generation_log = log
    return log
