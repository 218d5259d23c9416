"""The HTTP process's side of run-time LoRA loading: one answer per load or unload.

Runs on: the caller's thread (`load`, `unload`: any thread) and the engine client's
receiver thread (`done`). Owns: the futures of the loads and unloads sent and not yet
answered, per (adapter name, load or unload) in the order sent (the core answers them in
that order). Receives `LoraDone` from the core; emits LoadLora and UnloadLora through the
client's send, and each caller's answer: None, or why it failed.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future

from engine.core.messages import LoadLora, LoraDone, ToCore, UnloadLora

__all__ = ["LoraDone", "LoraRequests"]


class LoraRequests:
    def __init__(
        self,
        send: Callable[[ToCore], None],
        on_failure: Callable[[Callable[[BaseException], None]], None],
    ) -> None:
        """`on_failure`: registers a call for when the core dies (its questions then get
        the failure as their answer)."""
        self._send = send
        self._lock = threading.Lock()
        self._waiting: defaultdict[tuple[str, bool], deque[Future[str | None]]] = defaultdict(deque)
        on_failure(lambda error: self.fail(f"the engine failed: {error}"))

    def load(self, name: str, path: str) -> Future[str | None]:
        """The core reads the adapter's folder; the future holds None or why it failed."""
        return self._ask((name, True), LoadLora(name, path))

    def unload(self, name: str) -> Future[str | None]:
        return self._ask((name, False), UnloadLora(name))

    def done(self, answer: LoraDone) -> None:
        with self._lock:
            waiting = self._waiting.get((answer.name, answer.loaded))
            future = waiting.popleft() if waiting else None
        if future is not None:
            future.set_result(answer.error)

    def fail(self, why: str) -> None:
        """The core is gone: every question left is answered with why."""
        with self._lock:
            futures = [f for waiting in self._waiting.values() for f in waiting]
            self._waiting.clear()
        for future in futures:
            future.set_result(why)

    def _ask(self, key: tuple[str, bool], message: ToCore) -> Future[str | None]:
        future: Future[str | None] = Future()
        with self._lock:
            self._waiting[key].append(future)
        self._send(message)
        return future
