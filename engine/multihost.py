"""Multi-host serving of the engine core: one SPMD program over several processes.

JAX is multi-controller: every process runs the same jitted programs on the global mesh,
in the same order (their collectives meet across hosts). Process 0's engine core decides
everything: its scheduler plans each step, and the step's device work is one host-only
`StepCall` (engine.core.runner) that `Leader` sends to every follower before process 0
dispatches it (`Runner.mirror`), warm-up included. A follower (`follow`) builds the same
EngineCore from the config process 0 sends first, at the same time as process 0 (placing
arrays on the global mesh is collective), with the page count process 0 decides while
building (so shapes cannot differ); then it executes each call as it arrives, in order,
waiting for each to finish (nothing queues without bound); it never reads a result.

Runs on: process 0's engine core process (`Leader`, from engine.core.process) and each
follower's main thread (`follow`, from server.__main__). Owns: the command channel (TCP
from process 0's port, the coordinator's plus one; followers connect out to it), its wire
format, and joining and leaving jax.distributed. A follower receives `Setup`, `Pages`,
then `Step`s, then `Stop`; process 0 receives one `Hello` from each follower at start-up.

The wire: each message one msgpack frame (msgspec, decoded against its declared type)
after a 4-byte big-endian length; arrays travel as (dtype, shape, bytes). No pickle: a
frame can only be one of these messages, and a malformed one is a `ChannelError`, never
an object. Process 0 listens only until every follower has joined, before jax.distributed
starts, so a process that cannot be reached is a clear error within the timeout
(jax.distributed itself would abort the process with a stack trace). Disaggregated mode
is not combined with it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import struct
import time
from collections.abc import Callable
from typing import IO, Annotated, Any, TypeVar

import jax
import msgspec
import numpy as np

from engine.attention import AttentionBatch
from engine.core.config import CoreConfig
from engine.core.core import EngineCore
from engine.core.runner import StepCall
from engine.paged_model import StepBatch
from engine.sampling import SamplingArrays

logger = logging.getLogger(__name__)

_RETRY_S = 0.2
_HELLO_S = 2.0  # a follower says who it is as it connects; a silent peer is not one
_LENGTH = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # far above any step's arrays: a larger length is not a frame
_DTYPE_KINDS = "biuf"  # bool, signed and unsigned ints, floats: all a step's arrays hold
# StepBatch's arrays but attention and LoRA's optional slots (each a field of Step's own)
_BATCH_FIELDS = tuple(
    f.name for f in dataclasses.fields(StepBatch) if f.name not in ("attention", "lora")
)
_ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionBatch))
_SAMPLING_FIELDS = SamplingArrays._fields
_CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(CoreConfig))


class ChannelError(ValueError):
    """A frame that is not one of the channel's messages, or a channel cut inside one."""


# --- the wire format ----------------------------------------------------------------


class Array(msgspec.Struct, frozen=True, array_like=True):
    """A numpy array's exact bits; checked whole on arrival (a bad one never decodes)."""

    dtype: str  # numpy's dtype.str: "<i4", "|b1", "<f4", "<u4"
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    data: bytes

    def __post_init__(self) -> None:
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ValueError(f"unknown dtype {self.dtype!r}") from exc
        if dtype.kind not in _DTYPE_KINDS:
            raise ValueError(f"dtype {self.dtype!r} is not a number type")
        if len(self.data) != math.prod(self.shape) * dtype.itemsize:
            raise ValueError(f"{len(self.data)} bytes for a {self.dtype} array of {self.shape}")

    @classmethod
    def of(cls, value: Any) -> Array:
        array = np.ascontiguousarray(value)
        return cls(array.dtype.str, array.shape, array.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.dtype(self.dtype)).reshape(self.shape)


class Hello(msgspec.Struct, frozen=True, tag=True):
    """A follower's first frame: who it is."""

    process_id: int


class Setup(msgspec.Struct, frozen=True, tag=True):
    """The engine core every follower builds: process 0's CoreConfig, field by field."""

    core: dict[str, Any]

    def __post_init__(self) -> None:
        unknown = set(self.core) - _CORE_FIELDS
        if unknown:
            raise ValueError(f"unknown core config fields {sorted(unknown)}")


class Pages(msgspec.Struct, frozen=True, tag=True):
    """The KV cache's page count, as process 0 decided it while building its core."""

    num_pages: Annotated[int, msgspec.Meta(ge=1)]


class Step(msgspec.Struct, frozen=True, tag=True):
    """One StepCall, every array as process 0 built it."""

    batch: dict[str, Array]  # StepBatch's arrays but attention
    attention: dict[str, Array]  # AttentionBatch's
    rows: Array
    emits: Array
    fresh: Array
    sampling: dict[str, Array]  # SamplingArrays'
    generated: Array
    recount: tuple[tuple[int, Array], ...]
    following: Array | None
    carry: Array | None  # tokens read from the step before (engine.core.runner)
    lora: Array | None = None  # each token's LoRA slot (engine.lora), when adapters are served

    def __post_init__(self) -> None:
        for name, got, want in (
            ("batch", self.batch, _BATCH_FIELDS),
            ("attention", self.attention, _ATTENTION_FIELDS),
            ("sampling", self.sampling, _SAMPLING_FIELDS),
        ):
            if set(got) != set(want):
                raise ValueError(f"{name} has fields {sorted(got)}, not {sorted(want)}")

    @classmethod
    def of(cls, call: StepCall) -> Step:
        batch = call.batch
        return cls(
            batch=_wire(batch, _BATCH_FIELDS),
            attention=_wire(batch.attention, _ATTENTION_FIELDS),
            rows=Array.of(call.rows),
            emits=Array.of(call.emits),
            fresh=Array.of(call.fresh),
            sampling=_wire(call.sampling, _SAMPLING_FIELDS),
            generated=Array.of(call.generated),
            recount=tuple((row, Array.of(ids)) for row, ids in call.recount),
            following=None if call.following is None else Array.of(call.following),
            carry=None if call.carry is None else Array.of(call.carry),
            lora=None if batch.lora is None else Array.of(batch.lora),
        )

    def call(self) -> StepCall:
        attention = AttentionBatch(**_arrays(self.attention))
        lora = None if self.lora is None else self.lora.array()
        batch = StepBatch(**_arrays(self.batch), attention=attention, lora=lora)
        return StepCall(
            batch=batch,
            rows=self.rows.array(),
            emits=self.emits.array(),
            fresh=self.fresh.array(),
            sampling=SamplingArrays(**_arrays(self.sampling)),
            generated=self.generated.array(),
            recount=tuple((row, ids.array()) for row, ids in self.recount),
            following=None if self.following is None else self.following.array(),
            carry=None if self.carry is None else self.carry.array(),
        )


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Process 0's core has stopped: leave jax.distributed with it and exit."""


ToFollower = Setup | Pages | Step | Stop

_encoder = msgspec.msgpack.Encoder()
_to_follower = msgspec.msgpack.Decoder(ToFollower)
_hello = msgspec.msgpack.Decoder(Hello)
_Message = TypeVar("_Message")


def _wire(value: Any, names: tuple[str, ...]) -> dict[str, Array]:
    return {name: Array.of(getattr(value, name)) for name in names}


def _arrays(wire: dict[str, Array]) -> dict[str, Any]:
    return {name: array.array() for name, array in wire.items()}


def frame(message: Hello | ToFollower) -> bytes:
    """A message as it goes on the channel: its length, then its msgpack."""
    payload = _encoder.encode(message)
    return _LENGTH.pack(len(payload)) + payload


def read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame's payload; None when the channel closed cleanly between frames."""
    header = stream.read(_LENGTH.size)
    if not header:
        return None
    if len(header) < _LENGTH.size:
        raise ChannelError("the channel closed inside a frame's length")
    (size,) = _LENGTH.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ChannelError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    payload = stream.read(size)
    if len(payload) < size:
        raise ChannelError(f"the channel closed {len(payload)} bytes into a {size}-byte frame")
    return payload


def _read(stream: IO[bytes], decoder: msgspec.msgpack.Decoder[_Message]) -> _Message | None:
    payload = read_frame(stream)
    if payload is None:
        return None
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError too: fields and arrays checked
        raise ChannelError(f"a malformed message: {exc}") from exc


def receive(stream: IO[bytes]) -> ToFollower | None:
    """A follower's next message from process 0; None once process 0 has closed."""
    return _read(stream, _to_follower)


# --- start-up and leaving -------------------------------------------------------------


def channel_address(coordinator: str) -> tuple[str, int]:
    """Process 0's command port: the coordinator's, plus one."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be host:port, got {coordinator!r}")
    return host.strip("[]"), int(port) + 1


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
            pid = _hello_of(conn, min(_HELLO_S, max(_RETRY_S, deadline - time.monotonic())))
            if pid is None or not 0 < pid <= followers or pid in joined:
                conn.close()  # not one of ours
                continue
            joined[pid] = conn
    finally:
        server.close()  # nobody else may join later
    return [joined[pid] for pid in sorted(joined)]


def _hello_of(conn: socket.socket, timeout: float) -> int | None:
    """The process id a new connection says it is; None if it says nothing we can read."""
    conn.settimeout(timeout)
    try:
        with conn.makefile("rb") as stream:
            hello = _read(stream, _hello)
    except (OSError, ChannelError):
        return None
    conn.settimeout(None)
    return None if hello is None else hello.process_id


def join(coordinator: str, process_id: int, timeout: float) -> socket.socket:
    """A follower: connect to process 0, retrying until the timeout."""
    address = channel_address(coordinator)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(address, timeout=_RETRY_S * 5)
            if conn.getsockname() == conn.getpeername():
                # nobody listens and the kernel gave the connecting socket that very port
                # as its own (TCP self-connect): it reached itself, not process 0
                conn.close()
                raise ConnectionRefusedError("connected to itself")
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"could not reach process 0 at {address[0]}:{address[1]} within "
                    f"{timeout:g} s ({exc}): check --coordinator-address"
                ) from exc
            time.sleep(_RETRY_S)
    conn.settimeout(None)
    conn.sendall(frame(Hello(process_id)))
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
    # every process's backend starts at once (they exchange their devices): now, not when
    # a follower's core is built, which waits on process 0's Setup
    jax.devices()


def leave() -> None:
    """Every process leaves jax.distributed together (a barrier): one that just exits makes
    the others' distributed runtime abort them."""
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway; say why
        logger.warning("leaving jax.distributed failed", exc_info=True)


# --- process 0 ------------------------------------------------------------------------


class Leader:
    """Process 0's end of the channel: one socket per follower, in process id order.

    Used from the core loop's thread only (build, then each step, then stop), so the
    order of sends is the order of dispatch.
    """

    def __init__(self, followers: list[socket.socket]) -> None:
        self._followers = followers

    @classmethod
    def start(cls, coordinator: str, num_processes: int, timeout: float) -> Leader:
        """Wait for every follower to join, then jax.distributed as process 0."""
        followers = lead(coordinator, num_processes - 1, timeout)
        initialize(coordinator, num_processes, 0, timeout)
        return cls(followers)

    def build(self, config: CoreConfig) -> EngineCore:
        """The engine core, built with the followers building theirs; every step its runner
        executes (warm-up first) goes to them before it runs here."""
        if config.tensor_parallel_size != jax.device_count():
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size}: a multi-host server "
                f"shards the model over all {jax.device_count()} devices of its "
                f"{jax.process_count()} processes"
            )
        self._send(Setup(config.to_fields()))
        core = EngineCore(config, agree_pages=self._decide_pages)
        core.runner.mirror = self.mirror
        return core

    def _decide_pages(self, count: Callable[[], int]) -> int:
        num_pages = count()
        self._send(Pages(num_pages))
        return num_pages

    def mirror(self, call: StepCall) -> None:
        self._send(Step.of(call))

    def stop(self) -> None:
        """After the core's last step: the followers stop, and everyone leaves together."""
        try:
            self._send(Stop())
        except OSError:
            logger.warning("a follower was gone before the stop", exc_info=True)
        for conn in self._followers:
            conn.close()
        leave()

    def _send(self, message: ToFollower) -> None:
        data = frame(message)
        for conn in self._followers:
            conn.sendall(data)  # a slow follower holds process 0 here: the bound on queuing


# --- the others -----------------------------------------------------------------------


def follow(conn: socket.socket) -> int:
    """A follower: build process 0's core with it, then run each of its steps as it
    arrives, in order, until it says stop. 0 then; 1 if process 0 went away first."""
    with conn, conn.makefile("rb") as stream:

        def expect(kind: type[_Message]) -> _Message:
            message = receive(stream)
            if not isinstance(message, kind):
                got = "nothing more" if message is None else type(message).__name__
                raise ChannelError(f"process 0 sent {got} where a {kind.__name__} goes")
            return message

        config = CoreConfig.from_fields(expect(Setup).core)
        # the pages are process 0's to count (from its devices' memory): this one is told
        runner = EngineCore(config, agree_pages=lambda _: expect(Pages).num_pages).runner
        logger.info("following process 0")
        while True:
            match receive(stream):
                case Step() as step:
                    launched = runner.execute(step.call())
                    jax.block_until_ready((launched.sampled, launched.prompt))
                case Stop():
                    logger.info("process 0 stopped: following ends")
                    return 0
                case None:
                    logger.error("process 0 went away without a stop")
                    return 1
                case other:
                    raise ChannelError(f"process 0 sent a {type(other).__name__} while serving")
