"""The engine core behind the orchestrator's interface: one loop thread over EngineCore.

Runs on: its own thread (the loop) plus the callers' threads (submit, abort, drain,
stats). Owns: the open requests and each sample's text stream (stop strings, EOS, the
token budget's last token); the EngineCore (scheduler and runner) is touched by the
loop thread only. Receives ActiveRequests (submit) and aborts through an inbox;
emits Deltas into each request's RequestStream, all of a sample's tokens in order on
this one path.

What the server's request path still needs from the slot engine's orchestrator is
refused here with a ValueError naming it (the server's 400): prompt logprobs and
structured outputs (grammar masks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.core import EngineCore
from engine.core.scheduler import Emitted, Sequence
from engine.orchestrator import OrchestratorStats
from engine.request import (
    ActiveRequest,
    Delta,
    RequestFailed,
    RequestStream,
    Unavailable,
    sample_samplings,
)
from engine.stages.detokenize import TextStream, TextStreamFactory
from engine.types import CacheStats, EngineLimits, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request: ActiveRequest
    stream: RequestStream
    samplings: tuple[SamplingParams, ...]
    max_tokens: int
    texts: dict[int, TextStream] = field(default_factory=dict)
    left: int = 0  # samples not yet ended


@dataclass(frozen=True)
class _Abort:
    request_id: str


class CoreService:
    """Serves ActiveRequests from an EngineCore on one loop thread."""

    def __init__(self, core: EngineCore, text_streams: TextStreamFactory) -> None:
        self._core = core
        self._text_streams = text_streams
        cfg = core.config
        self.limits = EngineLimits(
            max_model_len=cfg.max_model_len,
            max_prompt_len=cfg.max_model_len - 1,
            vocab_size=core.model_config.vocab_size,
        )
        self._inbox: queue.SimpleQueue[_Request | _Abort] = queue.SimpleQueue()
        self._open: dict[str, _Request] = {}  # loop thread only
        self._ids: set[str] = set()  # request ids in use, guarded by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dead = threading.Event()
        self._draining = False
        self._error: BaseException | None = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    # -- lifecycle (the orchestrator's) -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        self._listeners.append(listener)

    def wait_dead(self, timeout: float | None = None) -> bool:
        return self._dead.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; True once every open one has ended within `timeout`."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._ids:
                    return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(_Abort(""))  # wakes the loop
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # -- requests -----------------------------------------------------------------------
    def submit(self, request: ActiveRequest) -> RequestStream:
        if request.prompt_logprobs:
            raise ValueError("prompt_logprobs is not supported by the paged engine yet")
        if request.sampling.constraint is not None:
            raise ValueError("structured outputs are not supported by the paged engine yet")
        max_tokens = self.limits.check(len(request.prompt_ids), request.max_tokens)
        request.sampling.check_vocab(self.limits.vocab_size)
        samplings = sample_samplings(request)
        with self._lock:
            if not self.alive or self._stop.is_set():
                raise Unavailable("the engine core is not running")
            if self._draining:
                raise Unavailable("the server is shutting down")
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._ids.add(request.request_id)
        stream = RequestStream(request.request_id, request.n)
        self._inbox.put(_Request(request, stream, samplings, max_tokens, left=request.n))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> OrchestratorStats:
        pages = self._core.page_stats()
        with self._lock:
            running = len(self._ids)
        return OrchestratorStats(
            queued_requests=0,
            prefill_queue_depth=0,
            detokenize_queue_depth=0,
            running_requests=running,
            slots_in_use=pages.total - pages.free,
            max_slots=pages.total,
            alive=self.alive,
            draining=self._draining,
            generate_steps=self._steps,
            cache=CacheStats(decode_cache_bytes=self._core.kv_cache_bytes),
        )

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._receive(block=not self._core.scheduler.busy)
                events = self._core.step()
                if events:
                    self._steps += 1
                for event in events:
                    self._emit(event)
        except BaseException as exc:  # the loop's death fails every open request, loudly
            logger.exception("engine core loop failed")
            self._fail(exc)
        finally:
            self._dead.set()

    def _receive(self, block: bool) -> None:
        while True:
            try:
                message = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return
            block = False
            if isinstance(message, _Abort):
                self._on_abort(message.request_id)
            else:
                self._on_request(message)

    def _on_request(self, open_: _Request) -> None:
        request = open_.request
        self._open[request.request_id] = open_
        now = time.monotonic()
        open_.stream.timings.prefill_start = now
        for i, sampling in enumerate(open_.samplings):
            open_.texts[i] = self._text_streams(request, sampling)
            self._core.add(
                Sequence(f"{request.request_id}\x00{i}", request.prompt_ids, sampling,
                         open_.max_tokens)
            )  # fmt: skip

    def _on_abort(self, request_id: str) -> None:
        open_ = self._open.pop(request_id, None)
        if open_ is None:
            return
        for i in range(open_.request.n):
            self._core.abort(f"{request_id}\x00{i}")
        open_.stream.close(aborted=True)
        self._forget(request_id)

    def _emit(self, event: Emitted) -> None:
        request_id, _, index_text = event.seq_id.partition("\x00")
        open_ = self._open.get(request_id)
        if open_ is None:
            return
        index = int(index_text)
        text = open_.texts[index]
        step = text.add(event.token, last=event.finish_reason == "length")
        now = time.monotonic()
        timings = open_.stream.timings
        if timings.first_token is None:
            timings.first_token = timings.prefill_end = timings.inserted = now
        k = open_.samplings[index].logprobs
        logprobs = None
        if k is not None:
            top = tuple((int(i), float(p)) for i, p in event.top[:k])
            logprobs = (TokenLogprobs(token_id=event.token, logprob=event.logprob, top=top),)
        open_.stream.push(
            Delta(
                index=index,
                text=step.text,
                token_ids=(event.token,),
                logprobs=logprobs,
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
                prompt_tokens=len(open_.request.prompt_ids),
                completion_tokens=text.tokens,
                emitted=now,
            )
        )
        if step.finish_reason is None:
            return
        if event.finish_reason is None:  # a stop string, EOS or stop token: the text's rule
            self._core.abort(event.seq_id)
        open_.left -= 1
        if open_.left == 0:
            del self._open[request_id]
            open_.stream.close()
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        failure = RequestFailed(f"the engine core failed: {type(exc).__name__}: {exc}")
        for open_ in list(self._open.values()):
            open_.stream.close(error=failure)
        self._open.clear()
        with self._lock:
            self._ids.clear()
        for listener in self._listeners:
            listener(exc)
