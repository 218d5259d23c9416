"""Entrypoint: `python -m server` / `llm-server`. The only place logging is configured.

Signals: the first SIGTERM (or SIGINT) starts a drain (readiness 503, new
requests 503, in-flight ones finish up to --drain-timeout) and then the
process exits 0; a second signal exits at once. An engine core that fails ends the
process with exit code 1 so Kubernetes restarts it.

Connections: uvicorn's h11 protocol with deadlines on what a client owes
(`DeadlineProtocol`), so stalled sockets are cut instead of kept forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from engine.heap import freeze_startup_heap
from engine.model_source import resolve
from engine.types import CheckpointError
from server.backend import Backend
from server.config import ServerConfig, parse_config
from server.lifecycle import Runtime
from server.logs import configure_logging

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
FLUSH_S = 1.0  # after a fault: time for error responses (and probes saying 503) to go out


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 connection, cut when a client stalls before its request is read.

    uvicorn times only the idle gap after a response (`timeout_keep_alive`): a socket
    that never sends, or sends its headers a byte at a time, or trickles a body nobody
    reads, stayed open forever. Here the request line and headers must be complete
    within `header_timeout_s` of the connection opening (first request) or of their
    first byte (later requests); a response that ends while the client is still
    sending its body closes the connection. The body of a request that is read has
    its own deadline, in `BodyLimitMiddleware`.
    """

    header_timeout_s: float = 10.0  # set per server by `deadline_protocol`

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_deadline is None:
            self._arm_header_deadline()  # the first byte of a later request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()  # the headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # the rest of this body would only be read to be discarded

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection: no request headers within the deadline")
            self.transport.close()


def deadline_protocol(header_timeout_s: float) -> type[DeadlineProtocol]:
    """The connection class for one server, with its header deadline."""
    return type("DeadlineProtocol", (DeadlineProtocol,), {"header_timeout_s": header_timeout_s})


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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
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


def _load_and_freeze(config: ServerConfig) -> Backend:
    """The backend, then this process's startup objects frozen (engine.heap), so that no full
    collection walks them mid-stream; only the entrypoint's server does this, not the apps
    tests build in their own process."""
    from server.loading import load_backend

    backend = load_backend(config)
    logger.info("startup heap frozen", extra={"objects": freeze_startup_heap()})
    return backend


def build_server(config: ServerConfig) -> DrainingServer:
    """The HTTP server."""
    from sse_starlette.sse import AppStatus

    from server.app import create_app

    # We drain streams ourselves (server.lifecycle): sse-starlette must not cut them when
    # uvicorn's exit flag is set.
    AppStatus.disable_automatic_graceful_drain()

    app = create_app(config, functools.partial(_load_and_freeze, config))
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
        http=deadline_protocol(config.header_read_timeout),
        timeout_keep_alive=config.timeout_keep_alive,  # type: ignore[arg-type]  # float is fine
    )
    return DrainingServer(uv_config, app.state.runtime, config.drain_timeout)


def with_model_source(config: ServerConfig) -> ServerConfig:
    """`config` with --model resolved to the folder the engine loads (engine.model_source:
    the default model fetched, a GGUF prepared, the demo built) and its served name fixed,
    before anything starts; a CheckpointError names what cannot be served."""
    source = resolve(config.model, config.resolved_cache_dir)
    name = config.served_model_name or source.name
    return dataclasses.replace(config, model=source.folder, served_model_name=name)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ValueError as exc:
        print(f"llm-server: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(config.log_level, config.log_format)
    try:
        config = with_model_source(config)
    except CheckpointError as exc:
        logger.error("cannot serve the model: %s", exc)
        print(f"llm-server: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    logger.info(
        "starting",
        extra={
            "model": str(config.model),
            "served_model_name": config.model_name,
            "host": config.host,
            "port": config.port,
        },
    )
    if config.num_processes > 1 and config.process_id != 0:
        return follow_main(config)  # process 0's engine core process leads (engine.multihost)
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


def follow_main(config: ServerConfig) -> int:
    """A process other than 0: no HTTP; it joins process 0, then builds and runs process
    0's engine core, every step as process 0 runs it (engine.multihost.follow).

    SIGTERM does not stop it: process 0 drains and then says stop (Kubernetes signals every
    pod of the group at once)."""
    from engine import multihost
    from server.loading import enable_compile_cache

    address, process_id = config.coordinator_address, config.process_id
    assert address is not None and process_id is not None  # ServerConfig checked them
    timeout = config.distributed_timeout
    logger.info(
        "joining a multi-host server",
        extra={"process_id": process_id, "num_processes": config.num_processes},
    )
    try:
        leader = multihost.join(address, process_id, timeout)
        multihost.initialize(address, config.num_processes, process_id, timeout)
    except (RuntimeError, ValueError) as exc:
        logger.error("multi-host start failed: %s", exc)
        print(f"llm-server: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    # after jax.distributed, whose preemption notifier takes SIGTERM over when it starts
    signal.signal(signal.SIGTERM, lambda sig, frame: logger.info("SIGTERM: following on"))
    try:
        enable_compile_cache(config)
        code = multihost.follow(leader)
    except Exception:
        logger.exception("following process 0 failed")
        code = EXIT_FAILED
    logger.info("exiting", extra={"exit_code": code})
    if code == EXIT_OK:
        multihost.leave()
    return code


if __name__ == "__main__":
    sys.exit(main())
