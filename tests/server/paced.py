"""An engine at the server's seam (server.backend.EngineHandle) that emits one token per
request every `step_s`: slow streams to watch a drain, a full queue, a hang-up or the
latency metrics from the outside, exactly and without JAX.

Owns: a worker thread, the open requests (at most `max_running` emitting at once, the
others queued, at most `max_queued_samples` samples in all before Overloaded) and the
drain. Each token is the prompt's next id (wrapping), its text `<id>`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.types import EngineLimits, EngineStats
from frontend.request import (
    ActiveRequest,
    Delta,
    Overloaded,
    RequestFailed,
    RequestStream,
    Unavailable,
)
from server.backend import Backend


@dataclass
class _Open:
    request: ActiveRequest
    stream: RequestStream
    budget: int
    sent: int = 0


class PacedEngine:
    def __init__(self, step_s: float, max_queued_samples: int = 64, max_running: int = 2):
        self.step_s = step_s
        self.max_queued_samples = max_queued_samples
        self.max_running = max_running
        self.limits = EngineLimits(max_model_len=256, max_prompt_len=255, vocab_size=1000)
        self._lock = threading.Condition()
        self._open: list[_Open] = []
        self._draining = False
        self._stopped = False
        self._steps = 0
        threading.Thread(target=self._run, name="paced-engine", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._stopped

    def submit(self, request: ActiveRequest) -> RequestStream:
        budget = self.limits.check(len(request.prompt_ids), request.max_tokens)
        with self._lock:
            if self._draining or self._stopped:
                raise Unavailable("the server is shutting down")
            waiting = sum(o.request.n for o in self._open[self.max_running :])
            if waiting + request.n > self.max_queued_samples:
                raise Overloaded(waiting, retry_after_s=1.0)
            stream = RequestStream(request.request_id, request.n)
            self._open.append(_Open(request, stream, budget))
            self._lock.notify_all()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            for open_ in self._open:
                if open_.request.request_id == request_id:
                    self._open.remove(open_)
                    open_.stream.close(aborted=True)
                    self._lock.notify_all()
                    return

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._draining = True
            while self._open and time.monotonic() < deadline:
                self._lock.wait(0.01)
            drained = not self._open
        self.stop()
        return drained

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            opened, self._open = self._open, []
            self._lock.notify_all()
        for open_ in opened:
            open_.stream.close(error=RequestFailed("the server stopped before the request ended"))

    def stats(self) -> EngineStats:
        with self._lock:
            running = min(len(self._open), self.max_running)
            waiting = len(self._open) - running
        return EngineStats(
            waiting_requests=waiting,
            running_requests=running,
            kv_pages_used=running,
            kv_pages_total=self.max_running,
            alive=self.alive,
            draining=self._draining,
            steps=self._steps,
        )

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        pass

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._open and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                running = self._open[: self.max_running]
            time.sleep(self.step_s)
            self._steps += 1
            for open_ in running:
                self._emit(open_)

    def _emit(self, open_: _Open) -> None:
        request = open_.request
        token = request.prompt_ids[open_.sent % len(request.prompt_ids)]
        open_.sent += 1
        now = time.monotonic()
        timings = open_.stream.timings
        if timings.first_token is None:
            timings.prefill_start = timings.prefill_end = now
            timings.first_token = now
        last = open_.sent >= open_.budget
        for index in range(request.n):
            open_.stream.push(
                Delta(
                    index=index,
                    text=f"<{token}>",
                    token_ids=(token,),
                    logprobs=None,
                    finish_reason="length" if last else None,
                    stop_reason=None,
                    prompt_tokens=len(request.prompt_ids),
                    completion_tokens=open_.sent,
                    emitted=now,
                )
            )
        if last:
            with self._lock:
                if open_ in self._open:
                    self._open.remove(open_)
                self._lock.notify_all()
            open_.stream.close()


class CharTokenizer:
    """One token per character (its code point modulo 1000); decodes as the engine's text."""

    vocab_size = 1000
    special_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def validate_ids(self, ids: Sequence[int]) -> list[int]:
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError("token id outside the vocabulary")
        return list(ids)

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()


def paced_backend(step_s: float, max_queued_samples: int = 64) -> Backend:
    engine = PacedEngine(step_s, max_queued_samples)
    return Backend(tokenizer=CharTokenizer(), engine=engine, limits=engine.limits)  # type: ignore[arg-type]
