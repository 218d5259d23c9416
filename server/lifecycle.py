"""The serving state machine: loading -> ready -> draining -> stopped, or failed.

Runs on: the event loop (every method except the loader thread and the
engine's failure listener, which hop onto the loop). Owns: the loaded
backend, readiness, liveness, the count of in-flight generation requests and
the drain: the one owner of the serving state (the engine client only knows whether
its core process lives, and does the engine's half of a drain when told). It never
ends the process itself: it sets `exit_requested` and the entrypoint decides (exit
code 0 after a drain, 1 after a fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from server.backend import Backend
from server.errors import APIError

logger = logging.getLogger(__name__)

# After the engine has drained, the handlers still hold the last bytes of their
# responses (the final chunk, [DONE]); this is how long they get to send them.
SEND_LAST_BYTES_S = 2.0
# After a drain that timed out, the engine has failed the open requests; their
# handlers get this long to turn that into error events before drain_expired cuts them.
SEND_FAILURES_S = 1.0


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Runtime:
    """Holds the backend and answers the probes; one per app."""

    def __init__(self, loader: Callable[[], Backend]):
        self._loader = loader
        self.state = State.LOADING
        self.backend: Backend | None = None
        self.error: BaseException | None = None
        self.exit_code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0
        # asyncio.Event binds to a loop only when first awaited, so these can be made here.
        self._idle = asyncio.Event()
        self._idle.set()
        self.drain_expired = asyncio.Event()  # open requests end with an error when set
        self.exit_requested = asyncio.Event()  # the entrypoint stops the server when set
        self._loader_thread: threading.Thread | None = None

    # --- start-up -------------------------------------------------------------------
    def start(self) -> None:
        """Begin loading on a daemon thread; the probes answer meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._loader_thread = threading.Thread(target=self._load, name="model-loader", daemon=True)
        self._loader_thread.start()

    @property
    def loading(self) -> bool:
        """Whether the loader thread is still at work (loading weights, compiling shapes)."""
        return self._loader_thread is not None and self._loader_thread.is_alive()

    def _load(self) -> None:
        started = time.monotonic()
        try:
            backend = self._loader()
        except BaseException as exc:  # noqa: BLE001 - reported through the probes
            logger.exception("loading the model failed")
            self._call_soon(self._fail, exc)
            return
        logger.info("model ready", extra={"load_s": round(time.monotonic() - started, 3)})
        self._call_soon(self._loaded, backend)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone already
            self._loop.call_soon_threadsafe(fn, *args)

    def _loaded(self, backend: Backend) -> None:
        self.backend = backend
        backend.engine.add_failure_listener(self._failure_from_thread)
        if self.state is State.LOADING:
            self.state = State.READY
        elif self.state is not State.FAILED:  # drained or stopped while loading
            self._stop_backend_soon()

    # --- failure ----------------------------------------------------------------------
    def _failure_from_thread(self, *args: Any) -> None:
        error = next((a for a in args if isinstance(a, BaseException)), None)
        self._call_soon(self._fail, error or RuntimeError("the engine core died"))

    def _fail(self, error: BaseException) -> None:
        if self.state is State.FAILED:
            return
        self.error = error
        self.state = State.FAILED
        logger.error("engine failed; the server stops", extra={"error": repr(error)})
        self.request_exit(1)

    def request_exit(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
        self.exit_requested.set()

    # --- probes -----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Liveness: the process and its engine core are alive (loading counts as alive)."""
        if self.state is State.FAILED:
            return False
        return self.backend is None or self.backend.engine.alive

    @property
    def ready(self) -> bool:
        return self.state is State.READY and self.alive

    def stats(self) -> Any | None:
        if self.backend is None:
            return None
        return self.backend.engine.stats()

    def require_ready(self) -> Backend:
        """The backend, or a 503 that says why requests are refused."""
        if self.state is State.READY and self.backend is not None and self.alive:
            return self.backend
        reason = {
            State.LOADING: "the model is still loading",
            State.DRAINING: "the server is shutting down",
            State.STOPPED: "the server is shutting down",
        }.get(self.state, "the engine failed")
        if self.state is State.READY:
            reason = "the engine failed"
        return_error = APIError(503, f"server unavailable: {reason}", code="unavailable")
        raise return_error

    # --- in-flight requests and drain -------------------------------------------------
    def acquire(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self._inflight = max(0, self._inflight - 1)
        if self._inflight == 0:
            self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, let in-flight ones finish for up to `timeout` seconds.

        Returns True when all finished. At the timeout the engine fails
        what is still open (streams end with an error event and [DONE]); the
        handlers get a moment to send that before the server closes.
        """
        if self.state in (State.READY, State.LOADING):
            self.state = State.DRAINING
        logger.info("draining", extra={"inflight": self._inflight, "timeout_s": timeout})
        drained = True
        if self.backend is not None and self.state is not State.FAILED:
            drained = await asyncio.to_thread(self.backend.engine.drain, timeout)
        try:
            await asyncio.wait_for(
                self._idle.wait(), SEND_LAST_BYTES_S if drained else SEND_FAILURES_S
            )
        except asyncio.TimeoutError:
            drained = False
            self.drain_expired.set()
            try:
                await asyncio.wait_for(self._idle.wait(), SEND_LAST_BYTES_S)
            except asyncio.TimeoutError:
                logger.warning("requests still open after the drain timeout")
        logger.info("drain finished", extra={"drained": drained})
        return drained

    async def shutdown(self) -> None:
        """Stop the engine (after a drain or a fault)."""
        if self.state is not State.FAILED:
            self.state = State.STOPPED
        if self.backend is not None:
            await asyncio.to_thread(self.backend.engine.stop)

    def _stop_backend_soon(self) -> None:
        assert self.backend is not None
        threading.Thread(target=self.backend.engine.stop, daemon=True).start()
