"""engine.multihost's command channel on real sockets and the real runner's calls.

The codec: a StepCall the runner prepared (prompt chunk with prompt logprobs and a token
mask, a decode row rebuilt after preemption, seeded sampling with a logit bias) comes out
of a frame bit for bit; every malformed frame is a ChannelError, never an object. Joining:
only processes that say which follower they are join, in process id order; process 0 and
a follower that wait in vain say so within their timeouts. A follower builds the core
process 0 describes, with process 0's page count, runs each step, and ends 0 on Stop and
1 when process 0 goes away without one.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from engine import multihost
from engine.core.core import CoreConfig, EngineCore
from engine.core.runner import RowWork, StepCall, StepPlan
from engine.multihost import ChannelError, Hello, Pages, Setup, Step, Stop, frame
from engine.paged_model import Chunk
from engine.token_mask import token_bitmask
from engine.types import SamplingParams

CONFIG = dict(
    max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, chunk_size=16, page_size=8
)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint_of: Any) -> Path:
    return tiny_checkpoint_of("llama")


@pytest.fixture(scope="module")
def core(folder: Path) -> EngineCore:
    return EngineCore(CoreConfig(folder, num_pages=24, **CONFIG))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def call(core: EngineCore) -> StepCall:
    """A step the runner prepared: a prompt chunk and a decode row back from preemption."""
    vocab = core.model_config.vocab_size
    prompt = tuple(range(5, 17))
    seeded = SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2, logit_bias=((3, 2.5),))
    plan = StepPlan(
        (
            RowWork(
                Chunk(prompt, 0, (0, 1)),
                row=0,
                sampling=seeded,
                generated=0,
                fresh=True,
                allowed=token_bitmask([1, 2, 3], vocab),
                prompt_next=(*prompt[1:], -1),
                prompt_top=2,
            ),
            RowWork(
                Chunk((9,), 20, (2, 3, 4)),
                row=1,
                sampling=SamplingParams(temperature=0.0, seed=0),
                generated=4,
                prior=(9, 8, 7, 6),
            ),
            RowWork(  # scheduled ahead: its token is row 1 of the step before
                Chunk((0,), 30, (5, 6, 7, 8)),
                row=2,
                sampling=SamplingParams(temperature=0.0, seed=0),
                generated=7,
                carry=1,
            ),
        )
    )
    prepared = core.runner.prepare(plan)
    assert prepared.following is not None and prepared.recount  # every kind of field is set
    assert prepared.carry is not None
    return prepared


def leaves(value: Any, path: str = "call") -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, tuple):
        names = getattr(value, "_fields", range(len(value)))
        for name, item in zip(names, value, strict=True):
            yield from leaves(item, f"{path}.{name}")
    else:
        yield path, value


def through_socket(data: bytes) -> Any:
    sender, receiver = socket.socketpair()
    with sender, receiver, receiver.makefile("rb") as stream:
        sender.sendall(data)
        sender.shutdown(socket.SHUT_WR)
        return multihost.receive(stream), multihost.receive(stream)


def test_a_step_call_round_trips_bit_for_bit(call: StepCall) -> None:
    message, after = through_socket(frame(Step.of(call)))
    assert isinstance(message, Step) and after is None
    got = message.call()
    want, have = dict(leaves(call)), dict(leaves(got))
    assert have.keys() == want.keys() and len(want) > 20
    for path, value in want.items():
        other = have[path]
        assert type(other) is type(value), path
        if isinstance(value, np.ndarray):
            assert (other.dtype, other.shape) == (value.dtype, value.shape), path
            assert other.tobytes() == value.tobytes(), path
        else:
            assert other == value, path
    assert frame(Step.of(got)) == frame(Step.of(call))


def test_the_wire_covers_every_field_of_a_step_call() -> None:
    """A field added to StepCall must be added to Step too, or followers would drop it."""
    assert {f.name for f in dataclasses.fields(StepCall)} <= set(Step.__struct_fields__)


def wire(call: StepCall) -> dict[str, Any]:
    """A Step as plain msgpack values, to be broken."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(Step.of(call)))


def raw_frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def broken_steps() -> dict[str, Any]:
    return {
        "array bytes short": lambda m: m.update(rows=[*m["rows"][:2], m["rows"][2][:-1]]),
        "object dtype": lambda m: m.update(rows=["|O", *m["rows"][1:]]),
        "unknown dtype": lambda m: m.update(rows=["garbage", *m["rows"][1:]]),
        "negative shape": lambda m: m.update(rows=[m["rows"][0], [-1], m["rows"][2]]),
        "a sampling field missing": lambda m: m["sampling"].pop("key"),
        "an unknown batch field": lambda m: m["batch"].update(extra=m["rows"]),
        "an unknown message": lambda m: m.update(type="Exec"),
        "a field of the wrong type": lambda m: m.update(generated="zero"),
        "a field missing": lambda m: m.pop("following"),
    }


@pytest.mark.parametrize("name", sorted(broken_steps()))
def test_a_malformed_step_is_an_error_not_an_object(call: StepCall, name: str) -> None:
    message = wire(call)
    broken_steps()[name](message)
    with pytest.raises(ChannelError):
        multihost.receive(io.BytesIO(raw_frame(msgspec.msgpack.encode(message))))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode({"type": "Setup", "core": {"evil": 1}}),
        msgspec.msgpack.encode({"type": "Pages", "num_pages": 0}),
        msgspec.msgpack.encode(Stop()) + b"\x00",  # trailing bytes
        msgspec.msgpack.encode(Hello(1)),  # a follower's message, not for followers
    ],
    ids=["not msgpack", "unknown config field", "no pages", "trailing bytes", "a hello"],
)
def test_malformed_messages_are_errors(payload: bytes) -> None:
    with pytest.raises(ChannelError):
        multihost.receive(io.BytesIO(raw_frame(payload)))


def test_frames_cut_short_or_oversized_are_errors_and_a_clean_end_is_none() -> None:
    stop = frame(Stop())
    assert multihost.receive(io.BytesIO(b"")) is None
    assert multihost.receive(io.BytesIO(stop)) == Stop()
    for cut in (stop[:2], stop[:-1]):
        with pytest.raises(ChannelError, match="closed"):
            multihost.receive(io.BytesIO(cut))
    huge = struct.pack("!I", multihost.MAX_FRAME_BYTES + 1)
    with pytest.raises(ChannelError, match="a frame of"):
        multihost.receive(io.BytesIO(huge))


def test_channel_address_is_the_coordinator_port_plus_one() -> None:
    assert multihost.channel_address("10.0.0.5:1234") == ("10.0.0.5", 1235)
    assert multihost.channel_address("[::1]:80") == ("::1", 81)
    with pytest.raises(ValueError, match="host:port"):
        multihost.channel_address("leader")


def coordinator() -> str:
    """A coordinator address whose channel port (the next one) is free."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"127.0.0.1:{port - 1}"


def connect(address: str, timeout: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(multihost.channel_address(address), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_only_processes_that_say_which_follower_they_are_join() -> None:
    address = coordinator()
    joined: list[socket.socket] = []
    leading = threading.Thread(target=lambda: joined.extend(multihost.lead(address, 2, 20)))
    leading.start()
    strangers = [connect(address) for _ in range(3)]
    strangers[0].sendall(raw_frame(b"\xc1"))  # not a hello
    strangers[1].sendall(frame(Hello(7)))  # no such follower
    # strangers[2] says nothing: turned away after a short wait, not the whole timeout
    followers = {pid: multihost.join(address, pid, 20) for pid in (2, 1)}
    leading.join(30)
    assert not leading.is_alive() and len(joined) == 2
    for stranger in strangers:
        stranger.settimeout(5)
        assert stranger.recv(1) == b""  # closed
        stranger.close()
    for pid, conn in enumerate(joined, start=1):  # in process id order
        conn.sendall(frame(Pages(pid)))
        conn.close()
    for pid, conn in followers.items():
        with conn, conn.makefile("rb") as stream:
            assert multihost.receive(stream) == Pages(pid)


def test_waiting_in_vain_is_a_clear_error_within_the_timeout() -> None:
    address = coordinator()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"only 0 of 1 other processes joined .* 0.5 s"):
        multihost.lead(address, 1, 0.5)
    with pytest.raises(RuntimeError, match=r"could not reach process 0 at .* within 0.5 s"):
        multihost.join(address, 1, 0.5)
    assert time.monotonic() - started < 5


def test_a_follower_that_connects_to_itself_has_not_reached_process_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With nobody on process 0's port, a connect from a local port in the ephemeral range
    can be given that same port and reach itself (TCP self-connect): not a leader."""

    def self_connected(address: tuple[str, int], timeout: float) -> socket.socket:
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # again on every retry
        conn.bind(address)
        conn.connect(address)  # simultaneous open with itself
        return conn

    monkeypatch.setattr(multihost.socket, "create_connection", self_connected)
    address = coordinator()
    with pytest.raises(RuntimeError, match=r"could not reach process 0 .*connected to itself"):
        multihost.join(address, 1, 0.5)


def follow_in_thread(messages: list[bytes]) -> list[Any]:
    """`follow` on one end of a socket pair, fed `messages` (then closed) from the other."""
    mine, theirs = socket.socketpair()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(multihost.follow(theirs))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    with mine:
        for data in messages:
            mine.sendall(data)
    thread.join(120)
    assert not thread.is_alive()
    return outcome


def test_a_follower_builds_process_0s_core_and_runs_its_steps_until_stop(
    folder: Path, call: StepCall, caplog: pytest.LogCaptureFixture
) -> None:
    fields = {"model_path": str(folder), **CONFIG}  # its own budget: 4 x 8 pages
    messages = [frame(Setup(fields)), frame(Pages(24)), frame(Step.of(call)), frame(Stop())]
    with caplog.at_level(logging.INFO):
        outcome = follow_in_thread(messages)
    assert outcome == [0]
    assert "24 pages of 8 positions" in caplog.text  # process 0's count, not its own
    assert "process 0 stopped: following ends" in caplog.text


def test_a_follower_whose_process_0_goes_away_ends_1(folder: Path) -> None:
    fields = {"model_path": str(folder), **CONFIG}
    outcome = follow_in_thread([frame(Setup(fields)), frame(Pages(16))])
    assert outcome == [1]
    outcome = follow_in_thread([frame(Stop())])  # before any Setup
    assert len(outcome) == 1 and isinstance(outcome[0], ChannelError)


def test_a_step_calls_lora_slots_cross_the_wire(call: StepCall) -> None:
    """Each token's LoRA slot (engine.lora) reaches a follower as process 0 built it."""
    slots = np.arange(call.tokens, dtype=np.int32) % 3 - 1
    with_lora = dataclasses.replace(call, batch=dataclasses.replace(call.batch, lora=slots))
    message, _ = through_socket(frame(Step.of(with_lora)))
    assert isinstance(message, Step)
    got = message.call().batch.lora
    assert got is not None and got.dtype == slots.dtype and got.tobytes() == slots.tobytes()
    assert message.call().batch.tokens.tobytes() == np.asarray(call.batch.tokens).tobytes()
