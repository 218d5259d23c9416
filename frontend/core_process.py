"""The handle of the engine core's process: start it, watch it, send to it, stop it.

Runs on: the caller's thread (start, send, stop), one receiver thread (reads the core's
messages and hands each to `on_message`) and one watcher thread (waits on the process
and calls `on_exit` with its exit code). Owns: the child process, its temporary socket
folder and the two ZMQ sockets (PUSH for requests, PULL for outputs). Knows nothing of
requests: what the messages mean is the caller's (frontend.client).

The core process imports JAX; this module never does (it starts `python -m
engine.core.process` with the config as JSON on its command line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import zmq

from engine.core.messages import FromCore, Stop, ToCore, decode_from_core, encode
from engine.core.process import ProcessConfig

logger = logging.getLogger(__name__)

_STOP_S = 15.0  # a stopping core gets this long to exit before it is killed


class CoreProcess:
    """One engine core's child process and the sockets to it."""

    def __init__(self, config: ProcessConfig) -> None:
        """`config`'s addresses are replaced by this handle's own (ipc:// in a temporary
        folder it binds and removes)."""
        self._folder = tempfile.TemporaryDirectory(prefix="engine-core-")
        base = Path(self._folder.name)
        self.config = replace(
            config,
            requests_address=f"ipc://{base / 'requests'}",
            outputs_address=f"ipc://{base / 'outputs'}",
        )
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.bind(self.config.requests_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(self.config.outputs_address)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe
        self._process: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._exited = threading.Event()
        self._stopping = False

    def start(
        self,
        on_message: Callable[[FromCore], None],
        on_exit: Callable[[int, bool], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Start the child and the two threads. `on_message` runs on the receiver thread for
        each message; `on_exit(code, stopping)` on the watcher when the child ends;
        `on_error` when the receiver itself fails."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._process = subprocess.Popen(  # stdin: the core's lifeline (engine.core.process)
            [sys.executable, "-m", "engine.core.process", self.config.to_json()],
            env=env,
            stdin=subprocess.PIPE,
        )

        def receive() -> None:
            try:
                while not self._exited.is_set():
                    if self._outputs.poll(100):
                        on_message(decode_from_core(self._outputs.recv()))
            except zmq.ContextTerminated:
                pass
            except BaseException as exc:  # the frontend's own bug: fail loudly, never hang
                logger.exception("the engine client's receiver failed")
                on_error(exc)
            finally:
                self._outputs.close(linger=0)

        def watch() -> None:
            process = self._process
            assert process is not None
            code = process.wait()
            on_exit(code, self._stopping)
            self._exited.set()

        for target, name in ((receive, "engine-client"), (watch, "engine-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    def send(self, message: ToCore) -> None:
        data = encode(message)
        with self._send_lock:
            self._requests.send(data)

    def kill(self) -> None:
        """End a failed core at once (the watcher still reports its exit)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()

    def stop(self) -> None:
        """Ask the core to stop, kill it if it does not in time, and close everything."""
        self._stopping = True
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self.send(Stop())
            try:
                process.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not stop in %s s; killing it", _STOP_S)
                process.kill()
                process.wait()
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # a core still alive sees its lifeline end
        self._exited.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5.0)
        with self._send_lock:
            self._requests.close(linger=0)
        self._context.term()
        self._folder.cleanup()
