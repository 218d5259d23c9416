"""What the server hands the engine client and what it gets back.

`ActiveRequest` goes in through `EngineClient.submit`; a `RequestStream` comes back
and yields `Delta`s, in order, until all n samples have finished. The output
processor (frontend.output, on the receiver thread) pushes into the stream; the
consumer iterates it either from asyncio (`async for`, woken with
`loop.call_soon_threadsafe`) or from a plain thread (`for`). A stream is closed
exactly once: finished, aborted, or failed. Owns: these types and the errors a submit
or a stream raises (the server maps each to its HTTP status).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from engine.types import MAX_LOGPROBS, EngineError, SamplingParams, TokenLogprobs


class Overloaded(EngineError):
    """The admission queue is full; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, queued: int, retry_after_s: float = 1.0):
        self.queued = queued  # samples waiting for prefill
        self.retry_after_s = retry_after_s
        super().__init__(f"server overloaded: {queued} samples already queued")


class Unavailable(EngineError):
    """The engine core is dead, not ready, draining or stopped (HTTP 503)."""


class RequestFailed(EngineError):
    """An open request failed because the core died or the server shut down before it ended."""


class RequestRejected(RequestFailed):
    """The engine could not take this request's data (HTTP 400); the server goes on serving."""


@dataclass(frozen=True)
class ActiveRequest:
    """One completion request as the engine sees it: token ids in, n samples out."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # seed None -> the input step draws a fresh one (frontend.input)
    max_tokens: int | None = 16  # None: until the context (max_model_len) is full
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # None: no prompt logprobs; k: at each prompt position after the first, the prompt
    # token's logprob and the top k alternatives (0 <= k <= MAX_LOGPROBS)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    lora: str = ""  # the LoRA adapter the request names as its model ("": the base model)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not self.prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if any(t < 0 for t in self.prompt_ids):
            raise ValueError("prompt token ids must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {k}")


@dataclass(frozen=True)
class Delta:
    """New output of one sample: text after stop-string hold-back, and the tokens it covers."""

    index: int  # which of the n samples
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None  # one per token in token_ids when asked
    finish_reason: str | None  # "stop" | "length" | None (only on a sample's last delta)
    stop_reason: str | int | None  # matched stop string or stop token id; None for EOS/length
    prompt_tokens: int
    completion_tokens: int  # cumulative for this sample
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # first delta only
    cached_tokens: int = 0  # prompt positions the engine took from its prefix cache
    emitted: float = 0.0  # time.monotonic() when the output processor pushed it


@dataclass
class RequestTimings:
    """Lifetime events of one request in time.monotonic() seconds; None until they happen.

    Written by the output processor (the receiver thread) as the core's outputs arrive (the core
    stamps when it first schedules the request), read by anyone after the stream ended.
    """

    queued: float
    prefill_start: float | None = None  # the core first scheduled it
    prefill_end: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.prefill_start is None else self.prefill_start - self.queued

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.queued

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.queued

    def phases(self) -> dict[str, float]:
        """Where the request's time went, in seconds, for the phases it has passed through:
        queue, prefill, decode (first token to the last), and ttft and total from being
        queued.
        DistServe's lifetime events; the Server-Timing header and /metrics read them."""
        spans = {
            "queue": (self.queued, self.prefill_start),
            "prefill": (self.prefill_start, self.prefill_end),
            "ttft": (self.queued, self.first_token),
            "decode": (self.first_token, self.finished),
            "total": (self.queued, self.finished),
        }
        return {
            name: max(0.0, end - start)
            for name, (start, end) in spans.items()
            if start is not None and end is not None
        }


@dataclass(frozen=True)
class _Closed:
    """Terminal marker of a stream: why it ended."""

    aborted: bool = False
    error: RequestFailed | None = None


class RequestStream:
    """Ordered deltas of one request, pushed by the output processor, read by one consumer.

    Thread-safe: `push` and `close` may be called from any thread; the first close wins
    and later pushes are dropped, so a failure and the receiver can race without harm.
    """

    def __init__(self, request_id: str, n: int = 1):
        self.request_id = request_id
        self.n = n
        self.timings = RequestTimings(queued=time.monotonic())
        self._items: deque[Delta] = deque()
        self._closed: _Closed | None = None
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    @property
    def finished(self) -> bool:
        """True once no more deltas will be added (finished, aborted or failed)."""
        return self._closed is not None

    def push(self, delta: Delta, wakeups: Wakeups | None = None) -> bool:
        """Append a delta; False when the stream is already closed. With `wakeups`, an
        asyncio consumer is woken when they are (`Wakeups.wake`), not at once."""
        with self._cond:
            if self._closed is not None:
                return False
            self._items.append(delta)
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if wakeups is None:
            _wake(waiter)
        elif waiter is not None:
            wakeups.add(waiter)
        return True

    def close(self, *, aborted: bool = False, error: RequestFailed | None = None) -> bool:
        """End the stream; False when it was already closed."""
        with self._cond:
            if self._closed is not None:
                return False
            self._closed = _Closed(aborted=aborted, error=error)
            self.timings.finished = time.monotonic()
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        _wake(waiter)
        return True

    def __iter__(self) -> Iterator[Delta]:
        while True:
            with self._cond:
                while not self._items and self._closed is None:
                    self._cond.wait()
                if self._items:
                    item = self._items.popleft()
                else:
                    self._raise_if_failed()
                    return
            yield item

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    item: Delta | None = self._items.popleft()
                elif self._closed is not None:
                    self._raise_if_failed()
                    return
                else:
                    item = None
                    future: asyncio.Future[None] = loop.create_future()
                    self._waiter = (loop, future)
            if item is None:
                await future
            else:
                yield item

    def _raise_if_failed(self) -> None:
        closed = self._closed
        if closed is not None and closed.error is not None:
            raise closed.error


class Wakeups:
    """The asyncio consumers of a batch of pushes (one step's tokens), woken with one
    call per event loop: one wake-up of the loop a step rather than one a stream."""

    def __init__(self) -> None:
        self._futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}

    def add(self, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
        loop, future = waiter
        self._futures.setdefault(loop, []).append(future)

    def wake(self) -> None:
        futures, self._futures = self._futures, {}
        for loop, batch in futures.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_resolve_all, batch)


def _resolve_all(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        _resolve(future)


def _wake(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None) -> None:
    if waiter is None:
        return
    loop, future = waiter
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
