"""The HTTP process's engine client: requests out, ordered text deltas back.

Runs on: the callers' threads (submit, abort, drain, stop, stats) and the core handle's
receiver and watcher threads (frontend.core_process). Owns: whether the core process
lives (ready, failed: the error and the failure listeners) and what the core published
when ready (its limits, EOS ids, sizes). The serving state (loading, ready, draining,
stopped, failed) is server.lifecycle.Runtime's alone; `drain` is the engine's half of
its drain (refuse, wait for the open requests, stop). Delegates the open requests
to the output processor (frontend.output), the seeds and the AddRequest to the input
step (frontend.input), the process and its sockets to the core handle, run-time LoRA
loads and unloads to frontend.lora_requests.

If the core dies, every open request fails at once, health turns false (`alive`) and
the failure listeners run (the server exits non-zero).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.core.messages import Failed, FromCore, Log, LoraDone, Outputs, Ready, Stats
from engine.core.process import ProcessConfig
from engine.types import EngineLimits, EngineStats
from frontend.core_process import CoreProcess
from frontend.input import add_request, sample_samplings
from frontend.lora_requests import LoraRequests
from frontend.output import OutputProcessor
from frontend.request import ActiveRequest, RequestFailed, RequestStream
from frontend.text import TextStreamFactory

logger = logging.getLogger(__name__)


class EngineClient:
    """Starts the engine core's process and serves ActiveRequests through it."""

    def __init__(
        self,
        config: ProcessConfig,
        text_streams: TextStreamFactory,
        *,
        max_queued_samples: int = 256,
    ) -> None:
        self._eos: frozenset[int] = frozenset()  # the core's, sent when ready
        self._core = CoreProcess(config)
        self._outputs = OutputProcessor(text_streams, self._core.send, max_queued_samples)
        self._lock = threading.Lock()  # the error and the listeners
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._error: BaseException | None = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._stopped = False
        self._stats = Stats(0, 0, 1, 1, 0, 0, 0, 0, 0)
        self.info: Ready | None = None
        self.limits = EngineLimits(2, 1, 1)  # replaced by the core's on Ready
        self._handlers: dict[type, Callable[[FromCore], None]] = {
            Ready: self._on_ready,  # type: ignore[dict-item]
            Outputs: self._on_outputs,  # type: ignore[dict-item]
            Log: self._on_log,  # type: ignore[dict-item]
            Failed: self._on_failed,  # type: ignore[dict-item]
        }
        self.loras = LoraRequests(self._core.send, self.add_failure_listener)  # (server.lora)
        self._handlers[LoraDone] = self.loras.done  # type: ignore[assignment]

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        """Start the core process and wait until it has warmed up (or failed)."""
        self._core.start(self._on_message, self._on_exit, self._fail)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self._dead.is_set():
                raise RuntimeError(f"the engine core failed to start: {self._error}")
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the engine core was not ready in {timeout} s")
        assert self.info is not None
        return self.info

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._dead.is_set()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        with self._lock:
            if self._error is None:
                self._listeners.append(listener)
                return
            error = self._error
        listener(error)

    def drain(self, timeout: float) -> bool:
        """Refuse new requests, let open ones finish for up to `timeout` s, then stop."""
        self._outputs.refuse("the server is shutting down")
        left = self._outputs.wait_idle(timeout, self._dead)
        drained = left == 0 and self._error is None
        if not drained:
            logger.warning("drain ended with %d requests still open; failing them", left)
        self.stop()
        return drained

    def stop(self) -> None:
        """Stop the core now; requests still open fail with RequestFailed."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._outputs.fail_all(
            RequestFailed("the server stopped before the request ended"), "the engine is stopped"
        )
        self._core.stop()

    # -- requests -----------------------------------------------------------------------
    def submit(self, request: ActiveRequest) -> RequestStream:
        samplings = sample_samplings(request)
        return self._outputs.open(request, samplings, add_request(request, samplings))

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; no-op for an unknown or finished one."""
        self._outputs.abort(request_id)

    def stats(self) -> EngineStats:
        stats = self._stats
        info = self.info
        return EngineStats(
            waiting_requests=stats.waiting,
            running_requests=stats.running,
            kv_pages_used=stats.pages_total - stats.pages_free,
            kv_pages_total=stats.pages_total,
            alive=self.alive,
            draining=self._outputs.refusing,
            steps=stats.steps,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            prefix_cached_pages=stats.pages_cached,
            preemptions=stats.preemptions,
            kv_cache_bytes=0 if info is None else info.kv_cache_bytes,
            spec_drafts=stats.spec_drafts,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            spec_accepted_per_position=stats.spec_accepted_per_position,
            lora=(stats.lora_running, stats.lora_waiting, stats.max_loras),
            weight_bytes=0 if info is None else info.weight_bytes,
        )

    # -- the core's messages (the receiver thread) --------------------------------------
    def _on_message(self, message: FromCore) -> None:
        self._handlers[type(message)](message)

    def _on_ready(self, ready: Ready) -> None:
        self.info = ready
        self.limits = EngineLimits(ready.max_model_len, ready.max_model_len - 1, ready.vocab_size)
        self._eos = frozenset(ready.eos_token_ids)
        self._outputs.refuse(None)
        self._ready.set()

    def _on_log(self, log: Log) -> None:
        extra = None if log.traceback is None else {"traceback": log.traceback}
        logging.getLogger(log.name).log(log.level, "%s", log.message, extra=extra)

    def _on_failed(self, failed: Failed) -> None:
        self._fail(RuntimeError(f"the engine core failed: {failed.error}"))

    def _on_outputs(self, outputs: Outputs) -> None:
        self._stats = outputs.stats
        self._outputs.take(outputs)

    # -- failure ------------------------------------------------------------------------
    def _on_exit(self, code: int, stopping: bool) -> None:
        if not stopping:
            self._fail(RuntimeError(f"the engine core exited with code {code}"))
        self._dead.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            listeners, self._listeners = self._listeners, []
        self._outputs.fail_all(
            RequestFailed(f"the engine failed: {error}"), f"the engine failed: {error}"
        )
        self._dead.set()
        self._core.kill()
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("engine failure listener raised")
