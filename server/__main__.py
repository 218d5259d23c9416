"""Entrypoint: `python -m server` / `llm-server`. The only place logging is configured.

Signals: the first SIGTERM (or SIGINT) starts a drain (readiness 503, new
requests 503, in-flight ones finish up to --drain-timeout) and then the
process exits 0; a second signal exits at once. A stage fault ends the
process with exit code 1 so the orchestrator (Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from server.config import ServerConfig, parse_config
from server.lifecycle import Runtime
from server.logs import configure_logging

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
FLUSH_S = 1.0  # after a fault: time for error responses (and probes saying 503) to go out


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM meaning "drain, then exit" instead of "close streams now".

    It never re-raises the signal after serving (uvicorn's default), so a
    clean drain ends with exit code 0.
    """

    def __init__(self, config: uvicorn.Config, runtime: Runtime, drain_timeout: float):
        super().__init__(config)
        self.runtime = runtime
        self.drain_timeout = drain_timeout
        self.signals_received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._exit_when_requested())
        await super().serve(sockets)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals_received += 1
        if self.signals_received > 1 or self._loop is None:
            logger.warning("second signal: exiting now", extra={"signal": sig})
            self.runtime.exit_code = self.runtime.exit_code or EXIT_FAILED
            self.force_exit = True
            self.should_exit = True
            return
        logger.info("signal received: draining", extra={"signal": signal.Signals(sig).name})
        self._loop.call_soon_threadsafe(self._spawn, self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.runtime.drain(self.drain_timeout)
        self.runtime.request_exit(EXIT_OK)

    async def _exit_when_requested(self) -> None:
        await self.runtime.exit_requested.wait()
        if self.runtime.exit_code:
            await asyncio.sleep(FLUSH_S)
        self.should_exit = True


def build_server(config: ServerConfig) -> DrainingServer:
    from sse_starlette.sse import AppStatus

    from server.app import create_app

    # We drain streams ourselves; sse-starlette must not cut them on uvicorn's exit flag.
    AppStatus.disable_automatic_graceful_drain()
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        # uvloop ran our SIGTERM handler late or never while the loader thread compiled
        # (the signal was lost, or the process died of it with no drain); asyncio's loop runs it.
        loop="asyncio",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    return DrainingServer(uv_config, app.state.runtime, config.drain_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ValueError as exc:
        print(f"llm-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(config.log_level, config.log_format)
    logger.info(
        "starting",
        extra={
            "model": str(config.model) if config.model else "demo",
            "served_model_name": config.model_name,
            "host": config.host,
            "port": config.port,
        },
    )
    server = build_server(config)
    server.run()
    code = server.runtime.exit_code or EXIT_OK
    logger.info("exiting", extra={"exit_code": code})
    if server.runtime.loading:
        # Stopped during warm-up: the loader thread may be inside an XLA compile, which
        # cannot be interrupted, and finalizing the interpreter under it aborts the process
        # (a C++ terminate, exit 134). Nothing is in flight yet, so leave without finalizing.
        logging.shutdown()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
