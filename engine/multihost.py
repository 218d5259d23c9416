"""Multi-host serving: one SPMD program over several processes, process 0 leading.

JAX is multi-controller: every process runs the same jitted computations on the
global mesh, in the same order (their collectives meet across hosts). Process 0
runs the HTTP server and the orchestrator; its stages call the engine from two
threads. `LeaderEngine` makes each device-touching call atomic under one lock
and, before making it, sends it (the method and its host arguments) to every
follower, so the order in which process 0 dispatches is the order every
follower replays (`follow`). Prefixes cross as handles: each follower keeps its
own copy of every prefix it computed, under the number process 0 gave it.
Only process 0 reads results; a follower never decides anything.

The command channel is plain JSON lines over TCP (no pickle: a message can
only name an engine method and give it numbers), from process 0's port
(coordinator port + 1) to the followers, which connect out to it. Process 0
listens only until every follower has joined, before jax.distributed starts,
so a process that cannot be reached is a clear error within the timeout
(jax.distributed itself aborts the process with a stack trace).

A long prompt's chunks do not let decode steps through here (every call is
atomic, so a prefill holds the steps until it ends): multi-host trades that
for the model's size. Disaggregated mode is not combined with it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from engine.types import EngineProtocol, Prefix, SamplingParams

logger = logging.getLogger(__name__)

# Engine calls that reach the devices, mirrored in order; everything else is host-only.
MIRRORED = (
    "init_state",
    "prefill",
    "prefill_batch",
    "resample",
    "insert",
    "generate",
    "free",
    "set_masks",
)
_STATE_OPS = ("init_state", "insert", "generate", "free", "set_masks")
REQUEST_ERRORS = (ValueError, OverflowError)  # as the prefill stage counts them
_RETRY_S = 0.2


def channel_address(coordinator: str) -> tuple[str, int]:
    """Process 0's command port: the coordinator's, plus one."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be host:port, got {coordinator!r}")
    return host.strip("[]"), int(port) + 1


# --- start-up ----------------------------------------------------------------------


def lead(coordinator: str, followers: int, timeout: float) -> list[socket.socket]:
    """Process 0: wait for every follower to connect (each says its process id)."""
    _, port = channel_address(coordinator)
    server = socket.create_server(("", port), reuse_port=False)
    server.settimeout(_RETRY_S)
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(joined) < followers:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(joined)} of {followers} other processes joined process 0 "
                    f"(port {port}) within {timeout:g} s: check --num-processes and that "
                    "every process was started with this coordinator address"
                )
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(timeout)
            hello = json.loads(conn.makefile("r").readline() or "{}")
            pid = hello.get("process_id")
            if not isinstance(pid, int) or not 0 < pid <= followers or pid in joined:
                conn.close()  # not one of ours
                continue
            conn.settimeout(None)
            joined[pid] = conn
    finally:
        server.close()  # nobody else may join later
    return [joined[pid] for pid in sorted(joined)]


def join(coordinator: str, process_id: int, timeout: float) -> socket.socket:
    """A follower: connect to process 0, retrying until the timeout."""
    address = channel_address(coordinator)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(address, timeout=_RETRY_S * 5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"could not reach process 0 at {address[0]}:{address[1]} within "
                    f"{timeout:g} s ({exc}): check --coordinator-address"
                ) from exc
            time.sleep(_RETRY_S)
    conn.settimeout(None)
    conn.sendall(json.dumps({"process_id": process_id}).encode() + b"\n")
    return conn


def initialize(coordinator: str, num_processes: int, process_id: int, timeout: float) -> None:
    """jax.distributed over every process (gloo collectives on CPU); after the channel."""
    # on the CPU backend collectives across processes need gloo; other backends ignore it
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(max(1, timeout)),
    )


# --- the wire format ----------------------------------------------------------------


class _FixedMask:
    """A follower's stand-in for a request's constraint: only its first mask is needed."""

    def __init__(self, words: np.ndarray):
        self._words = words

    def initial_mask(self) -> np.ndarray:
        return self._words

    def matcher(self) -> Any:
        raise RuntimeError("followers never match grammars: process 0 does")


class _StateMarker:
    """Where the decode state goes in a call: each process passes its own."""


_STATE = _StateMarker()


def _encode(value: Any, handles: Callable[[Prefix], int]) -> Any:
    if value is _STATE:
        return {"state": True}
    if isinstance(value, Prefix):
        return {"prefix": handles(value)}
    if isinstance(value, SamplingParams):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        constraint = fields.pop("constraint", None)
        if constraint is not None:
            fields["initial_mask"] = _array(np.asarray(constraint.initial_mask()))
        return {"sampling": _encode(fields, handles)}
    if isinstance(value, np.ndarray | np.generic):
        return _array(np.asarray(value))
    if isinstance(value, dict):
        return {"dict": {k: _encode(v, handles) for k, v in value.items()}}
    if isinstance(value, list | tuple):
        return [_encode(v, handles) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} to the followers")


def _array(a: np.ndarray) -> dict[str, Any]:
    data = base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()
    return {"array": data, "dtype": a.dtype.str, "shape": list(a.shape)}


def _decode(value: Any, prefixes: dict[int, Prefix]) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v, prefixes) for v in value)
    if not isinstance(value, dict):
        return value
    if "prefix" in value:
        return prefixes[value["prefix"]]
    if "array" in value:
        raw = base64.b64decode(value["array"])
        return np.frombuffer(raw, np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if "sampling" in value:
        fields = _decode(value["sampling"], prefixes)
        mask = fields.pop("initial_mask", None)
        if mask is not None:
            fields["constraint"] = _FixedMask(mask)
        return SamplingParams(**fields)
    return {k: _decode(v, prefixes) for k, v in value["dict"].items()}


# --- process 0 -------------------------------------------------------------------------


class LeaderEngine:
    """The engine of process 0, each device call mirrored to the followers first.

    Implements EngineProtocol by delegation; host-only attributes pass through.
    """

    def __init__(self, engine: Any, followers: Sequence[socket.socket]):
        self._engine = engine
        self._followers = list(followers)
        self._lock = threading.RLock()
        self._handles: dict[int, int] = {}  # id(prefix) -> handle, while the prefix lives
        self._next = 0
        self._dropped: deque[int] = deque()  # handles of prefixes gone, sent with the next call
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _handle(self, prefix: Prefix) -> int:
        return self._handles[id(prefix)]

    def _register(self, prefix: Prefix) -> None:
        handle = self._next
        self._next += 1
        self._handles[id(prefix)] = handle
        weakref.finalize(prefix, self._forget, id(prefix), handle)

    def _forget(self, key: int, handle: int) -> None:
        self._handles.pop(key, None)
        self._dropped.append(handle)  # any thread, any time: only queued here

    def _send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        for conn in self._followers:
            conn.sendall(line)

    def _call(self, op: str, *args: Any, state_at: int | None = None, **kwargs: Any) -> Any:
        """Mirror then make one call; args[state_at] is the decode state (each its own)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the multi-host engine is closed")
            dropped = [self._dropped.popleft() for _ in range(len(self._dropped))]
            wire = [_STATE if i == state_at else a for i, a in enumerate(args)]
            args_, kwargs_ = _encode([wire, kwargs], self._handle)
            self._send({"op": op, "args": args_, "kwargs": kwargs_["dict"], "drop": dropped})
            result = getattr(self._engine, op)(*args, **kwargs)
            if op in ("prefill", "resample"):
                self._register(result)
            elif op == "prefill_batch":
                for prefix in result:
                    self._register(prefix)
            return result

    def init_state(self) -> Any:
        return self._call("init_state")

    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_logprobs: int | None = None,
        between_chunks: Callable[[], None] | None = None,
    ) -> Prefix:
        # between_chunks is dropped: a decode step between two chunks would be dispatched
        # here in an order the followers cannot know
        return self._call("prefill", list(token_ids), sampling, prompt_logprobs=prompt_logprobs)

    def prefill_batch(self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]) -> Any:
        return self._call("prefill_batch", [(list(ids), s) for ids, s in prompts])

    def resample(self, prefix: Prefix, sampling: SamplingParams) -> Prefix:
        return self._call("resample", prefix, sampling)

    def insert(self, prefix: Prefix, state: Any, slot: int) -> Any:
        return self._call("insert", prefix, state, slot, state_at=1)

    def generate(self, state: Any, batch: int | None = None) -> Any:
        return self._call("generate", state, batch, state_at=0)

    def free(self, state: Any, slot: int) -> Any:
        return self._call("free", state, slot, state_at=0)

    def set_masks(self, state: Any, slots: Any, allowed: Any) -> Any:
        return self._call("set_masks", state, np.asarray(slots), np.asarray(allowed), state_at=0)

    def receive(self, prefix: Prefix) -> Prefix:
        raise RuntimeError("multi-host serving does not combine with disaggregated mode")

    def close(self) -> None:
        """Tell the followers to stop (after the orchestrator's last engine call)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._send({"op": "stop"})
            except OSError:
                logger.warning("a follower was gone before the stop", exc_info=True)
            for conn in self._followers:
                conn.close()


# --- the others ------------------------------------------------------------------------


def _messages(conn: socket.socket) -> Iterator[dict[str, Any]]:
    with conn.makefile("r", encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)


def follow(engine: EngineProtocol, conn: socket.socket) -> int:
    """Replay process 0's engine calls until it says stop; 0 then, 1 if it went away."""
    prefixes: dict[int, Prefix] = {}
    state: Any = None
    made = 0  # handles are numbered in the order process 0 made its prefixes
    for message in _messages(conn):
        op = message["op"]
        if op == "stop":
            logger.info("process 0 stopped: following ends")
            return 0
        for handle in message.get("drop", ()):
            prefixes.pop(handle, None)
        args = [state if _is_state(a) else _decode(a, prefixes) for a in message["args"]]
        kwargs = {k: _decode(v, prefixes) for k, v in message["kwargs"].items()}
        if op not in MIRRORED:
            raise RuntimeError(f"process 0 sent an unknown engine call {op!r}")
        try:
            result = getattr(engine, op)(*args, **kwargs)
        except REQUEST_ERRORS:  # process 0 got the same error for the same request
            logger.debug("a mirrored %s failed as on process 0", op, exc_info=True)
            continue
        if op in ("prefill", "resample"):
            prefixes[made] = result
            made += 1
        elif op == "prefill_batch":
            for prefix in result:
                prefixes[made] = prefix
                made += 1
        elif op in _STATE_OPS:
            state = result[0] if op == "generate" else result
    logger.error("process 0 went away without a stop")
    return 1


def _is_state(value: Any) -> bool:
    return isinstance(value, dict) and value.get("state") is True
