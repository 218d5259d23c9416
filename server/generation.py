"""Submit a plan's requests to the orchestrator and read their deltas as one ordered feed.

Runs on: the event loop. Owns: the RequestStreams of one HTTP request, from
submit to the last delta; it aborts every unfinished one when the reader goes
away (client disconnect, drain timeout, error), so a slot is never held for a
client that is no longer listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from engine.request import (
    ActiveRequest,
    Delta,
    Overloaded,
    RequestFailed,
    RequestRejected,
    RequestStream,
    Unavailable,
)
from engine.types import PromptTooLongError
from server.errors import APIError, bad_request

logger = logging.getLogger(__name__)


class OrchestratorLike(Protocol):
    """The orchestrator methods a request handler uses."""

    def submit(self, request: ActiveRequest) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class PromptDelta:
    """A delta of the prompt at `prompt_index` in the request's list of prompts."""

    prompt_index: int
    delta: Delta


class DrainExpired(Exception):
    """The drain timeout passed while this request was still running."""


def submit_all(
    orchestrator: OrchestratorLike, requests: tuple[ActiveRequest, ...]
) -> list[RequestStream]:
    """Submit every request or none: a refusal aborts those already queued."""
    streams: list[RequestStream] = []
    try:
        for request in requests:
            streams.append(orchestrator.submit(request))
    except BaseException as exc:
        for stream in streams:
            orchestrator.abort(stream.request_id)
        raise submit_error(exc) from exc
    return streams


def submit_error(exc: BaseException) -> BaseException:
    """The client-facing form of an orchestrator refusal."""
    if isinstance(exc, Overloaded):
        retry = max(1, round(exc.retry_after_s))
        return APIError(
            429,
            str(exc),
            code="overloaded",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc) or "server unavailable", code="unavailable")
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc


def failure_error(exc: BaseException) -> APIError:
    """The client-facing form of a request that failed after it was accepted."""
    if isinstance(exc, DrainExpired):
        return APIError(503, "server shut down before the request finished", code="shutdown")
    if isinstance(exc, RequestRejected):
        return bad_request(f"the engine rejected the request: {exc}", code="invalid_value")
    if isinstance(exc, RequestFailed):
        return APIError(503, f"request failed: {exc}", code="engine_failure")
    logger.error("request failed unexpectedly", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


async def feed(
    orchestrator: OrchestratorLike,
    streams: list[RequestStream],
    stop_event: asyncio.Event | None = None,
    on_stream_end: Callable[[RequestStream], None] | None = None,
) -> AsyncIterator[PromptDelta]:
    """Deltas of all streams in arrival order (each stream's own order kept).

    Raises RequestFailed when a stream fails and DrainExpired when `stop_event`
    is set first. However it ends, unfinished streams are aborted.
    """
    queue: asyncio.Queue[PromptDelta | BaseException | int] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait(PromptDelta(index, delta))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait(exc)
            return
        queue.put_nowait(index)

    async def watch_stop() -> None:
        assert stop_event is not None
        await stop_event.wait()
        queue.put_nowait(DrainExpired())

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    if stop_event is not None:
        tasks.append(asyncio.create_task(watch_stop()))
    open_streams = len(streams)
    try:
        while open_streams:
            item = await queue.get()
            if isinstance(item, PromptDelta):
                yield item
            elif isinstance(item, BaseException):
                raise item
            else:
                open_streams -= 1
                if on_stream_end is not None:
                    on_stream_end(streams[item])
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            if not stream.finished:
                orchestrator.abort(stream.request_id)
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
