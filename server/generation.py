"""One accepted generation request, from submit to its last byte.

Runs on: the event loop. Owns: the request's RequestStreams, its place in the
drain count, its metrics and its access-log fields. A `Generation` submits
every prompt of a plan or none, merges the prompt streams through one queue of
typed events, records each token's metrics as it arrives, maps every failure
to one `APIError` and aborts what is unfinished exactly once (`close`).
Completions and chat only format: their `Shaper` turns deltas into chunks and
the whole body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from engine.types import PromptTooLongError
from frontend.request import (
    Delta,
    Overloaded,
    RequestFailed,
    RequestRejected,
    RequestStream,
    RequestTimings,
    Unavailable,
)
from server.backend import Backend, EngineHandle
from server.errors import APIError, bad_request
from server.lifecycle import Runtime, State
from server.metrics import EngineMetrics
from server.params import GenerationPlan
from server.streaming import DONE, encode_event, error_event
from server.timing import phases_ms

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RequestLog:
    """Fields the access log line reports for a generation request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class PromptDelta:
    """A delta of the prompt at `prompt_index` in the request's list of prompts."""

    prompt_index: int
    delta: Delta


@dataclass(frozen=True)
class _StreamEnded:
    prompt_index: int


@dataclass(frozen=True)
class _StreamFailed:
    error: BaseException


@dataclass(frozen=True)
class _DrainExpired:
    """The drain timeout passed while this request was still running."""


_Event = PromptDelta | _StreamEnded | _StreamFailed | _DrainExpired


class Shaper(Protocol):
    """An endpoint's formatting of one request: deltas in, OpenAI-shaped dicts out."""

    def opening(self) -> list[dict[str, Any]]:
        """Chunks streamed before any token (chat's role chunks)."""
        ...

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        """Fold a delta into the response; the chunk to stream for it, if any."""
        ...

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]: ...

    def response(self, completion_tokens: int) -> dict[str, Any]: ...


class Generation:
    """Streams, metrics, errors and cleanup of one accepted generation request."""

    def __init__(
        self,
        runtime: Runtime,
        backend: Backend,
        plan: GenerationPlan,
        metrics: EngineMetrics,
        log: RequestLog,
    ):
        self._runtime = runtime
        self._engine: EngineHandle = backend.engine
        self.plan = plan
        self._metrics = metrics
        self._log = log
        self._streams = self._submit_all()
        runtime.acquire()
        self._closed = False
        self._last_token: dict[tuple[int, int], float] = {}  # (prompt, sample) -> emitted
        self._started: set[int] = set()  # prompts whose first token has arrived
        log.prompt_tokens = sum(len(p.ids) for p in plan.prompts)
        metrics.observe_prompt(log.prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return self._log.completion_tokens

    # --- submit and close -----------------------------------------------------------

    def _submit_all(self) -> list[RequestStream]:
        """Submit every prompt or none: a refusal aborts those already queued."""
        streams: list[RequestStream] = []
        try:
            for request in self.plan.requests:
                streams.append(self._engine.submit(request))
        except BaseException as exc:
            for stream in streams:
                self._engine.abort(stream.request_id)
            raise _submit_error(exc) from exc
        return streams

    async def close(self) -> None:
        """Abort what is unfinished and leave the drain count; runs once, however it ends."""
        if self._closed:
            return
        self._closed = True
        for stream in self._streams:
            if not stream.finished:
                self._engine.abort(stream.request_id)
        self._runtime.release()

    # --- the merged feed ------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[PromptDelta]:
        """Every delta, each prompt's in order; raises APIError when the request fails."""
        queue: asyncio.Queue[_Event] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait(PromptDelta(index, delta))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                queue.put_nowait(_StreamFailed(exc))
                return
            queue.put_nowait(_StreamEnded(index))

        async def watch_drain() -> None:
            await self._runtime.drain_expired.wait()
            queue.put_nowait(_DrainExpired())

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        tasks.append(asyncio.create_task(watch_drain()))
        open_streams = len(self._streams)
        try:
            while open_streams:
                event = await queue.get()
                if isinstance(event, PromptDelta):
                    self._observe(event)
                    yield event
                elif isinstance(event, _StreamEnded):
                    open_streams -= 1
                    self._metrics.observe_end(self._streams[event.prompt_index].timings)
                else:
                    raise self._failed(event)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    def _observe(self, item: PromptDelta) -> None:
        """Metrics and log fields of one delta, at the moment it reaches the server."""
        delta = item.delta
        timings = self._streams[item.prompt_index].timings
        if item.prompt_index not in self._started:  # TTFT is observed at the first token
            self._started.add(item.prompt_index)
            self._metrics.observe_first_token(timings)
            ttft = timings.ttft_s
            if ttft is not None and (self._log.ttft_s is None or ttft < self._log.ttft_s):
                self._log.ttft_s = ttft
        key = (item.prompt_index, delta.index)  # inter-token latency per sample
        last = self._last_token.get(key)
        if last is not None:
            self._metrics.observe_inter_token(delta.emitted - last)
        self._last_token[key] = delta.emitted
        if delta.finish_reason is not None:
            tokens = 0 if self.plan.discard_output else delta.completion_tokens
            self._metrics.observe_sample(delta.finish_reason, tokens)
            self._log.completion_tokens += tokens
            self._log.finish_reasons.append(delta.finish_reason)

    def _failed(self, event: _StreamFailed | _DrainExpired) -> APIError:
        """The one client-facing error of a request that failed after it was accepted."""
        if isinstance(event, _DrainExpired):
            kind, error = "DrainExpired", _shutdown_error()
        elif isinstance(event.error, RequestRejected):
            kind = "RequestRejected"
            error = bad_request(f"the engine rejected the request: {event.error}")
        elif isinstance(event.error, RequestFailed):
            if self._runtime.state in (State.DRAINING, State.STOPPED):
                kind, error = "DrainExpired", _shutdown_error()  # the drain timeout stopped it
            else:
                kind = "RequestFailed"
                error = APIError(503, f"request failed: {event.error}", code="engine_failure")
        else:
            logger.error("request failed unexpectedly", exc_info=event.error)
            kind = type(event.error).__name__
            error = APIError(500, "internal server error", code="internal_error")
        self._log.error = kind
        self._metrics.observe_failure(kind)
        return error

    # --- the two response forms -------------------------------------------------------

    async def complete(self, shaper: Shaper) -> dict[str, Any]:
        """The whole response (non-streaming); raises APIError."""
        try:
            async for item in self.deltas():
                shaper.apply(item)
        finally:
            await self.close()
        return shaper.response(self.completion_tokens)

    @property
    def timings(self) -> list[RequestTimings]:
        """Each prompt's lifetime events (complete once the generation has ended)."""
        return [stream.timings for stream in self._streams]

    async def stream(self, shaper: Shaper) -> AsyncIterator[bytes]:
        """SSE events: chunks, the usage chunk when asked, then [DONE]; errors as an event."""
        try:
            for chunk in shaper.opening():
                yield encode_event(chunk)
            async for item in self.deltas():
                piece = shaper.apply(item)
                if piece is not None:
                    yield encode_event(piece)
            if self.plan.include_usage:
                usage = shaper.usage_chunk(self.completion_tokens)
                yield encode_event(usage | {"server_timing": phases_ms(self.timings)})
        except APIError as error:
            yield error_event(error)
        except Exception:  # a formatting bug: the client still gets an error and [DONE]
            logger.exception("streaming a response failed")
            self._log.error = "internal_error"
            yield error_event(APIError(500, "internal server error", code="internal_error"))
        finally:
            await self.close()
        yield DONE


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


def _shutdown_error() -> APIError:
    return APIError(503, "server shut down before the request finished", code="shutdown")


def _submit_error(exc: BaseException) -> BaseException:
    """The client-facing form of an engine refusal."""
    if isinstance(exc, Overloaded):
        retry = max(1, round(exc.retry_after_s))
        return APIError(429, str(exc), code="overloaded", headers={"Retry-After": str(retry)})
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc) or "server unavailable", code="unavailable")
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc
