"""The output processor: the one owner of the open requests on the HTTP process's side.

Runs on: the receiver thread (`take`, one step's outputs at a time) and the callers'
threads (`open`, `abort`, `refuse`, `fail_all`, `wait_idle`); every method holds the
one lock, so no two of them interleave. Owns: the open requests (stream, seeded
samplings, each sample's text stream, the samples not yet ended and those that have a
first token), the admission count (samples submitted without a first token) and the
recent sample ends that estimate Retry-After. Receives the core's `Outputs`; emits
Deltas into each RequestStream (every token of a sample on this one path, in order:
DESIGN's JetStream lesson) and `Abort`s for samples a stop string ended.

Why one lock over whole steps: the admission count is changed by a first token (here)
and by an abort (a caller): with both under the lock, an abort either comes before the
token (the token then finds no open sample and is dropped) or after it (the sample is
then counted as started and not subtracted again), never between the check and the count.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.messages import Abort, AddRequest, Outputs, ToCore, TokenOut
from engine.types import SamplingParams, TokenLogprobs
from frontend.request import (
    ActiveRequest,
    Delta,
    Overloaded,
    RequestFailed,
    RequestRejected,
    RequestStream,
    Unavailable,
    Wakeups,
)
from frontend.text import TextStep, TextStream, TextStreamFactory

_RATE_WINDOW = 64  # samples whose end times estimate the service rate for Retry-After
_MAX_RETRY_AFTER_S = 60.0


@dataclass
class OpenRequest:
    """One request between submit and its last delta."""

    request: ActiveRequest
    stream: RequestStream
    samplings: tuple[SamplingParams, ...]
    texts: dict[int, TextStream] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)  # samples not yet ended
    started: set[int] = field(default_factory=set)  # samples that have a first token


class OutputProcessor:
    """Open requests in, Deltas out; `send` reaches the core (an Abort, the AddRequest)."""

    def __init__(
        self,
        text_streams: TextStreamFactory,
        send: Callable[[ToCore], None],
        max_queued_samples: int,
    ) -> None:
        self._text_streams = text_streams
        self._send = send
        self._max_queued = max_queued_samples
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open: dict[str, OpenRequest] = {}
        self._waiting = 0
        self._sample_ends: deque[float] = deque(maxlen=_RATE_WINDOW)
        self._refusal: str | None = "the engine is not ready"

    @property
    def refusing(self) -> bool:
        """Whether new requests are refused (not ready, draining, stopped or failed)."""
        with self._lock:
            return self._refusal is not None

    def refuse(self, reason: str | None) -> None:
        """New requests get Unavailable(reason) from now on (None: accept them again)."""
        with self._lock:
            self._refusal = reason

    def open(
        self, request: ActiveRequest, samplings: tuple[SamplingParams, ...], message: AddRequest
    ) -> RequestStream:
        """Admit a request and send its AddRequest (under the lock: the core sees requests
        in the order they were admitted), or raise Unavailable / Overloaded / ValueError."""
        stream = RequestStream(request.request_id, request.n)
        open_ = OpenRequest(request, stream, samplings, live=set(range(request.n)))
        for index, sampling in enumerate(samplings):
            open_.texts[index] = self._text_streams(request, sampling)
        with self._lock:
            if self._refusal is not None:
                raise Unavailable(self._refusal)
            if request.request_id in self._open:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if self._waiting + request.n > self._max_queued:
                raise Overloaded(self._waiting, self._retry_after_s(self._waiting))
            self._open[request.request_id] = open_
            self._waiting += request.n
            self._send(message)
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; no-op for an unknown or finished one."""
        with self._lock:
            open_ = self._close(request_id)
        if open_ is not None:
            open_.stream.close(aborted=True)

    def take(self, outputs: Outputs) -> None:
        """One step's outputs: rejections, then every token in order."""
        wakeups = Wakeups()  # one wake-up of the event loop for the step's tokens
        try:
            with self._lock:
                for request_id, why in outputs.rejected:
                    self._reject(request_id, why)
                for token in outputs.tokens:
                    self._token(token, wakeups)
        finally:
            wakeups.wake()

    def fail_all(self, error: RequestFailed, refusal: str) -> None:
        """Every open request ends with `error`; new ones are refused with `refusal`."""
        with self._lock:
            self._refusal = refusal
            opened = list(self._open.values())
            self._open.clear()
            self._waiting = 0
            self._idle.notify_all()
        for open_ in opened:
            open_.stream.close(error=error)

    def wait_idle(self, timeout: float, dead: threading.Event) -> int:
        """Wait up to `timeout` s for every open request to end (or the core to die);
        returns how many are still open."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._open and not dead.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(min(remaining, 0.1))
            return len(self._open)

    # -- under the lock -------------------------------------------------------------------
    def _close(self, request_id: str) -> OpenRequest | None:
        """Forget a request and tell the core to drop its live samples."""
        open_ = self._open.pop(request_id, None)
        if open_ is None:
            return None
        self._waiting -= len(open_.live - open_.started)
        self._idle.notify_all()
        live = tuple((request_id, i) for i in sorted(open_.live))
        if live:
            self._send(Abort(live))
        return open_

    def _reject(self, request_id: str, why: str) -> None:
        """The core could not serve this request (a 400); the others go on."""
        open_ = self._close(request_id)
        if open_ is not None:
            open_.stream.close(error=RequestRejected(why))

    def _token(self, out: TokenOut, wakeups: Wakeups) -> None:
        open_ = self._open.get(out.request_id)
        if open_ is None or out.index not in open_.live:
            return  # aborted meanwhile (its stream is closed), or ended by a stop string
        if out.error is not None:
            self._reject(out.request_id, f"structured output failed: {out.error}")
            return
        now = time.monotonic()
        if out.index not in open_.started:
            open_.started.add(out.index)
            self._waiting -= 1
            timings = open_.stream.timings
            if timings.first_token is None:
                timings.prefill_start = out.scheduled or now
                timings.prefill_end = timings.first_token = now
        text = open_.texts[out.index]
        step = text.add(out.token, finish=out.finish, done=out.done, stop_token=out.stop_reason)
        open_.stream.push(_delta(open_, out, step, text.tokens, now), wakeups)
        if step.finish_reason is None:
            return
        open_.live.discard(out.index)
        if out.finish is None:  # a text rule ended it first: the core stops it too
            self._send(Abort(((out.request_id, out.index),)))
        if not open_.live:
            del self._open[out.request_id]
            self._sample_ends.extend([now] * open_.request.n)
            self._idle.notify_all()
            open_.stream.close()

    def _retry_after_s(self, backlog: int) -> float:
        ends = self._sample_ends
        if len(ends) >= 2 and ends[-1] > ends[0]:
            rate = (len(ends) - 1) / (ends[-1] - ends[0])
        else:
            rate = 8.0  # nothing measured yet
        return min(_MAX_RETRY_AFTER_S, max(1.0, backlog / rate))


def _delta(open_: OpenRequest, out: TokenOut, step: TextStep, tokens: int, now: float) -> Delta:
    """One token's Delta: its text step, logprobs as the sample asked, prompt logprobs."""
    sampling = open_.samplings[out.index]
    k = sampling.logprobs
    logprobs = None
    if k is not None:  # the top k, or every one of the logprob_token_ids asked
        top = out.top if sampling.logprob_token_ids else out.top[:k]
        logprobs = (TokenLogprobs(out.token, out.logprob, top),)
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = tuple(
            None if e is None else TokenLogprobs(e[0], e[1], e[2]) for e in out.prompt_logprobs
        )
    return Delta(
        index=out.index,
        text=step.text,
        token_ids=(out.token,),
        logprobs=logprobs,
        finish_reason=step.finish_reason,
        stop_reason=step.stop_reason,
        prompt_tokens=len(open_.request.prompt_ids),
        completion_tokens=tokens,
        prompt_logprobs=prompt,
        cached_tokens=out.cached_tokens,
        emitted=now,
    )
