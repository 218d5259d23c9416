"""The generate stage: continuous batching over a fixed set of slots.

Runs on: the generate thread. Owns: the decode state and the slot table
(which lease holds which slot, the free slots, the pending prefixes); no
other code reads or writes them. Receives: PrefillDone, ReleaseSlot,
CancelJob (generate inbox). Emits: SlotAssigned, StepTokens (detokenize
queue), with device arrays it never waits on.

It blocks only when no slot is busy and nothing is pending. A slot is freed
here as soon as its sample has used its token budget (max_tokens or the
context end), and otherwise when the detokenize stage says the sample ended.
Budgets are counted here only: the message that carries a sample's last
token says so, and the detokenize stage ends the sample on it.
Slots are handed out lowest first, so the busy ones sit low, and each step
runs the engine's smallest decode bucket that covers the highest busy slot.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.stages.faults import Fault
from engine.stages.messages import (
    NO_LEASE,
    CancelJob,
    DetokenizeMessage,
    GenerateMessage,
    Job,
    PrefillDone,
    ReleaseSlot,
    SlotAssigned,
    StepTokens,
)
from engine.stages.queues import POLL_S, Credits, StepClock, put
from engine.types import EngineProtocol


@dataclass
class _Occupant:
    """A sample in a slot, as the generate stage tracks it."""

    lease: int
    job: Job
    tokens: int  # tokens this sample has produced so far, the prefill's included


class GenerateStage:
    def __init__(
        self,
        engine: EngineProtocol,
        inbox: queue.Queue[GenerateMessage],
        outbox: queue.Queue[DetokenizeMessage],
        credits: Credits,
        stop: threading.Event,
        fault: Fault,
        clock: StepClock | None = None,
    ):
        self._engine = engine
        self._clock = clock if clock is not None else StepClock()
        self._inbox = inbox
        self._outbox = outbox
        self._credits = credits
        self._stop = stop
        self._fault = fault
        self._state: Any = None
        self._slots: list[_Occupant | None] = [None] * engine.max_slots
        self._free = list(range(engine.max_slots))  # a heap: lowest slot first
        self._pending: deque[PrefillDone] = deque()
        self._next_lease = 0
        self._leases: tuple[int, ...] = (NO_LEASE,) * engine.max_slots
        self.slots_in_use = 0  # gauge: written here only, read by stats()
        self.steps = 0  # counter: written here only

    def run(self) -> None:
        self._state = self._engine.init_state()
        handlers = {
            PrefillDone: self._on_prefill_done,
            ReleaseSlot: self._on_release,
            CancelJob: self._on_cancel,
        }
        while not self._stop.is_set():
            for message in self._receive():
                handlers[type(message)](message)  # type: ignore[operator]
            self._insert_pending()
            if self.slots_in_use and not self._stop.is_set():
                self._step()
            else:
                self._clock.idle()

    def _receive(self) -> list[GenerateMessage]:
        """Everything in the inbox now; waits for the first message only when idle."""
        messages: list[GenerateMessage] = []
        if not self.slots_in_use and not self._pending:
            try:
                messages.append(self._inbox.get(timeout=POLL_S))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _on_prefill_done(self, message: PrefillDone) -> None:
        self._pending.append(message)

    def _on_release(self, message: ReleaseSlot) -> None:
        occupant = self._slots[message.slot]
        if occupant is not None and occupant.lease == message.lease:
            self._free_slot(message.slot)

    def _on_cancel(self, message: CancelJob) -> None:
        for slot, occupant in enumerate(self._slots):
            if occupant is not None and occupant.job is message.job:
                self._free_slot(slot)
        kept = [p for p in self._pending if p.job is not message.job]
        for _ in range(len(self._pending) - len(kept)):
            self._credits.release()
        self._pending = deque(kept)

    def _insert_pending(self) -> None:
        while self._pending and self._free:
            done = self._pending.popleft()
            self._credits.release()
            if done.job.cancelled.is_set():
                continue
            slot = heapq.heappop(self._free)
            self._state = self._engine.insert(done.prefix, self._state, slot)
            lease = self._next_lease
            self._next_lease += 1
            self._slots[slot] = _Occupant(lease, done.job, tokens=1)
            self.slots_in_use += 1
            self._set_lease(slot, lease)
            if done.job.stream.timings.inserted is None:
                done.job.stream.timings.inserted = time.monotonic()
            prefix = done.prefix
            last = done.job.max_new_tokens <= 1
            put(
                self._outbox,
                SlotAssigned(
                    slot=slot,
                    lease=lease,
                    job=done.job,
                    index=done.index,
                    token=prefix.token,
                    logprob=prefix.logprob,
                    top_ids=prefix.top_ids,
                    top_logprobs=prefix.top_logprobs,
                    prompt_logprobs=(
                        None if prefix.prompt_logprobs is None else tuple(prefix.prompt_logprobs)
                    ),
                    last=last,
                ),
                self._stop,
            )
            if last:
                self._free_slot(slot)

    def _step(self) -> None:
        self._fault.tick()
        highest = max(slot for slot, occupant in enumerate(self._slots) if occupant is not None)
        batch = self._engine.decode_bucket(highest + 1)
        self._state, output = self._engine.generate(self._state, batch)
        self.steps += 1
        spent: list[int] = []
        for slot, occupant in enumerate(self._slots):
            if occupant is None:
                continue
            occupant.tokens += 1
            if occupant.tokens >= occupant.job.max_new_tokens:
                spent.append(slot)
        put(self._outbox, StepTokens(output, self._leases, frozenset(spent)), self._stop)
        self._clock.stepped(output.tokens)
        for slot in spent:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self._state = self._engine.free(self._state, slot)
        self._slots[slot] = None
        heapq.heappush(self._free, slot)
        self.slots_in_use -= 1
        self._set_lease(slot, NO_LEASE)

    def _set_lease(self, slot: int, lease: int) -> None:
        leases = list(self._leases)
        leases[slot] = lease
        self._leases = tuple(leases)
