"""The generate stage: continuous batching over a fixed set of slots.

Runs on: the generate thread. Owns: the decode state and the slot table
(which lease holds which slot, the free slots, the pending prefixes); no
other code reads or writes them. Receives: PrefillDone, ReleaseSlot,
CancelJob (generate inbox). Emits: SlotAssigned, StepTokens (detokenize
queue), with device arrays it never waits on.

It blocks only when no slot is busy and nothing is pending, and holds its next
step while a prefill call has the turn (StepClock: calls and steps alternate on
shared devices, and a call's samples go into slots before the step after it).
A slot is freed here as soon as its sample has used its token budget (max_tokens
or the context end), and otherwise when the detokenize stage says it ended.
Budgets are counted here only: the message that carries a sample's last
token says so, and the detokenize stage ends the sample on it.
Slots are handed out lowest first, so the busy ones sit low, and each step
runs the engine's smallest decode bucket that covers the highest busy slot.

Structured outputs: a constrained sample's first token was sampled under its
grammar's first mask (prefill); every later one under the mask after the tokens
before it. A step with constrained slots sends their tokens to the grammar worker
(engine.stages.grammar) and holds its StepTokens back; right before the next step
the stage waits for the masks, writes them into the decode state (engine.set_masks),
dispatches the step and only then sends the held messages on, in order, marking the
samples the grammar completed ("stop"; their slots are freed here) and failing a
request whose grammar refused a token (that request only). Without constrained slots
none of this runs. The device idles between a constrained step and the next for the
host's part (the token copy, the masks, two dispatches): ~1 ms a step on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.sampling import token_bitmask
from engine.stages.faults import Fault
from engine.stages.grammar import Advanced, Constrained, GrammarWorker
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
from engine.stages.queues import POLL_S, Channel, Credits, StepClock, put
from engine.types import ConstraintMatcher, EngineProtocol

Reject = Callable[[Job, Exception], None]  # fails one request, the others go on


@dataclass
class _Occupant:
    """A sample in a slot, as the generate stage tracks it."""

    lease: int
    job: Job
    tokens: int  # tokens this sample has produced so far, the prefill's included
    matcher: ConstraintMatcher | None = None  # structured outputs: where its grammar is
    base: np.ndarray | None = None  # with a matcher: allowed_token_ids' words, if any


@dataclass
class _Held:
    """A message for the detokenize stage waiting for the grammar worker's answer (None:
    waiting only behind one that does, to keep the order)."""

    message: DetokenizeMessage
    answer: Future[Advanced] | None


class GenerateStage:
    def __init__(
        self,
        engine: EngineProtocol,
        inbox: queue.Queue[GenerateMessage],
        outbox: Channel[DetokenizeMessage],
        credits: Credits,
        stop: threading.Event,
        fault: Fault,
        clock: StepClock | None = None,
        reject: Reject | None = None,
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
        self._reject = reject
        self._held: deque[_Held] = deque()
        self.grammar: GrammarWorker | None = None  # started with the first constrained sample
        self.slots_in_use = 0  # gauge: written here only, read by stats()
        self.steps = 0  # counter: written here only

    def run(self) -> None:
        self._state = self._engine.init_state()
        handlers = {
            PrefillDone: self._on_prefill_done,
            ReleaseSlot: self._on_release,
            CancelJob: self._on_cancel,
        }
        try:
            while not self._stop.is_set():
                calls = self._clock.calls_ended  # before the inbox: what they handed on is in it
                for message in self._receive():
                    handlers[type(message)](message)  # type: ignore[operator]
                self._insert_pending()
                self._settle()
                if self.slots_in_use and not self._stop.is_set():
                    self._step(calls)
                else:
                    self._flush()
                    self._clock.idle()
        finally:
            if self.grammar is not None:
                self.grammar.close()

    def _receive(self) -> list[GenerateMessage]:
        """Everything in the inbox now; waits for the first message only when idle."""
        messages: list[GenerateMessage] = []
        if not self.slots_in_use and not self._pending and not self._held:
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
            self._clock.busy()
            lease = self._next_lease
            self._next_lease += 1
            occupant = _Occupant(lease, done.job, tokens=1)
            self._slots[slot] = occupant
            self._constrain(occupant, done.job.samplings[done.index])
            self.slots_in_use += 1
            self._set_lease(slot, lease)
            if done.job.stream.timings.inserted is None:
                done.job.stream.timings.inserted = time.monotonic()
            prefix = done.prefix
            last = done.job.max_new_tokens <= 1
            self._emit(
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
                    first_step=self.steps,
                ),
                self._advance_grammar(prefix.token, [slot]),
            )
            if last:
                self._free_slot(slot)

    def _step(self, calls_ended: int) -> None:
        if not self._clock.begin_step(self._stop, calls_ended):
            return  # a prefill call has the turn, or handed on samples to insert first
        self._fault.tick()
        highest = max(slot for slot, occupant in enumerate(self._slots) if occupant is not None)
        batch = self._engine.decode_bucket(highest + 1)
        self._state, output = self._engine.generate(self._state, batch)
        self._flush()  # the previous step's held messages, settled: after the dispatch
        self.steps += 1
        spent: list[int] = []
        for slot, occupant in enumerate(self._slots):
            if occupant is None:
                continue
            occupant.tokens += 1
            if occupant.tokens >= occupant.job.max_new_tokens:
                spent.append(slot)
        constrained = [s for s, o in enumerate(self._slots) if o is not None and o.matcher]
        answer = self._advance_grammar(output.tokens, constrained) if constrained else None
        self._emit(StepTokens(output, self._leases, frozenset(spent), step=self.steps - 1), answer)
        self._clock.stepped(output.tokens)
        for slot in spent:
            self._free_slot(slot)

    # -- structured outputs ------------------------------------------------------------

    def _constrain(self, occupant: _Occupant, sampling: Any) -> None:
        """Give a sample with a structured-output constraint its own matcher."""
        if sampling.constraint is None:
            return
        occupant.matcher = sampling.constraint.matcher()
        if sampling.allowed_token_ids is not None:
            words = np.asarray(sampling.constraint.initial_mask()).shape[0]
            occupant.base = token_bitmask(sampling.allowed_token_ids, words * 32)
        if self.grammar is None:
            self.grammar = GrammarWorker(np.asarray(sampling.constraint.initial_mask()).shape[0])

    def _advance_grammar(self, tokens: Any, slots: list[int]) -> Future[Advanced] | None:
        """Send these slots' tokens to the grammar worker (None when none is constrained)."""
        entries = []
        for slot in slots:
            occupant = self._slots[slot]
            if occupant is not None and occupant.matcher is not None:
                entries.append(Constrained(slot, occupant.lease, occupant.matcher, occupant.base))
        if not entries or self.grammar is None:
            return None
        return self.grammar.submit(tokens, entries)

    def _emit(self, message: DetokenizeMessage, answer: Future[Advanced] | None = None) -> None:
        """To the detokenize stage now, or held behind the grammar worker's answers."""
        if answer is None and not self._held:
            put(self._outbox, message, self._stop)
        else:
            self._held.append(_Held(message, answer))

    def _settle(self) -> None:
        """Wait for the grammar worker's answers and write the next masks into the decode
        state; the held messages, marked with the samples they complete, are then ready
        to go (`_flush`, after the next step is dispatched)."""
        if not any(held.answer is not None for held in self._held):
            return
        words = self.grammar.words if self.grammar is not None else 0
        slots = np.full((self._engine.max_slots,), self._engine.max_slots, np.int32)
        masks = np.full((self._engine.max_slots, words), -1, np.int32)
        for held in self._held:
            if held.answer is not None:
                answer = self._wait(held.answer)
                if answer is None:
                    return  # stopping
                self._take(answer, slots, masks)
                held.message = _completed(held.message, frozenset(answer.done))
                held.answer = None
        if (slots < self._engine.max_slots).any():
            self._state = self._engine.set_masks(self._state, slots, masks)

    def _flush(self) -> None:
        """Send the settled held messages on, in order."""
        while self._held and self._held[0].answer is None:
            put(self._outbox, self._held.popleft().message, self._stop)

    def _take(self, answer: Advanced, slots: np.ndarray, masks: np.ndarray) -> None:
        """Fail the requests whose grammar refused a token, free the samples it completed,
        and keep the next masks of those still in their slots."""
        for slot, lease, why in answer.failed:
            occupant = self._occupant(slot, lease)
            if occupant is not None:
                self._on_cancel(CancelJob(occupant.job))
                if self._reject is not None:
                    self._reject(occupant.job, ValueError(f"structured output failed: {why}"))
        for slot, lease in answer.done.items():
            if self._occupant(slot, lease) is not None:
                self._free_slot(slot)
        for slot, (lease, mask) in answer.masks.items():
            if self._occupant(slot, lease) is not None:
                slots[slot] = slot
                masks[slot] = mask

    def _occupant(self, slot: int, lease: int) -> _Occupant | None:
        """The slot's sample if it still holds the lease."""
        occupant = self._slots[slot]
        return occupant if occupant is not None and occupant.lease == lease else None

    def _wait(self, answer: Future[Advanced]) -> Advanced | None:
        while not self._stop.is_set():
            try:
                return answer.result(timeout=POLL_S)
            except FutureTimeout:
                continue
        return None

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


def _completed(message: DetokenizeMessage, done: frozenset[int]) -> DetokenizeMessage:
    """The message with the slots whose output its token completed marked `done`."""
    if isinstance(message, SlotAssigned):
        return dataclasses.replace(message, done=message.slot in done)
    return dataclasses.replace(message, done=done)
