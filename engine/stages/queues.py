"""Blocking primitives that give up when the orchestrator stops.

Every wait a stage does goes through these, with a short timeout and a check
of the shared stop event, so a failing or stopping orchestrator never leaves
a thread blocked on a queue nobody will touch again.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import jax

from engine.request import Overloaded
from engine.stages.messages import Job

T = TypeVar("T")

POLL_S = 0.05  # how long a blocked stage waits before it looks at the stop event again


class Channel(Protocol[T]):
    """What the blocking helpers need of a queue: queue.Queue's put and get."""

    def put(self, item: T, block: bool = True, timeout: float | None = None) -> None: ...
    def get(self, block: bool = True, timeout: float | None = None) -> T: ...


def put(q: Channel[T], item: T, stop: threading.Event) -> bool:
    """Put into a bounded queue, waiting for room; False if the orchestrator stopped first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def get(q: Channel[T], stop: threading.Event) -> T | None:
    """Take from a queue, waiting for an item; None if the orchestrator stopped first."""
    while not stop.is_set():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None


class FirstTokensAhead(Generic[T]):
    """The detokenize queue: generate steps in order, bounded; first tokens ahead of them.

    `put` of a step waits while `size` steps are queued (the detokenize stage's lag).
    A message for which `ahead(message)` holds (a SlotAssigned: a new sample's first
    token) never waits and is taken before every queued step: it needs no device
    work of theirs, and behind them it waited out each step's compute (two steps of
    the 70m-128k model at 16 slots: ~100 ms of every time to first token). A sample's
    later tokens cannot overtake its first: they ride in steps put after it. Steps
    put before a sample was inserted reach the detokenize stage after it, which tells
    them apart by their step numbers and leases (engine.stages.detokenize).

    The blocking calls have queue.Queue's signatures, so `put` and `get` above serve
    (`block` is taken for that and not read: they always pass a timeout).
    """

    def __init__(self, size: int, ahead: Callable[[T], bool]):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._ahead = ahead
        self._first: deque[T] = deque()
        self._steps: deque[T] = deque()
        self._cond = threading.Condition()

    def qsize(self) -> int:
        with self._cond:
            return len(self._first) + len(self._steps)

    def put(self, item: T, block: bool = True, timeout: float | None = None) -> None:
        with self._cond:
            if self._ahead(item):
                self._first.append(item)
            else:
                if not self._cond.wait_for(lambda: len(self._steps) < self.size, timeout):
                    raise queue.Full
                self._steps.append(item)
            self._cond.notify_all()

    def get(self, block: bool = True, timeout: float | None = None) -> T:
        with self._cond:
            if not self._cond.wait_for(lambda: self._first or self._steps, timeout):
                raise queue.Empty
            item = self._first.popleft() if self._first else self._steps.popleft()
            self._cond.notify_all()
            return item


class Credits:
    """A counting limit with a readable level: bounds prefixes held between prefill and insert.

    Prefill takes a credit before handing a Prefix on; the generate stage gives
    it back when the Prefix leaves its pending list. This bounds device memory
    held by prefilled prompts that wait for a slot.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"credit limit must be >= 1, got {limit}")
        self.limit = limit
        self._in_use = 0
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self, stop: threading.Event) -> bool:
        with self._cond:
            while self._in_use >= self.limit:
                if stop.is_set():
                    return False
                self._cond.wait(POLL_S)
            self._in_use += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._in_use -= 1
            self._cond.notify()


class AdmissionQueue:
    """The bounded backlog of admitted requests waiting for prefill, FIFO, removable by id.

    The bound counts samples (a request of n samples takes n places), so one
    request with a large n cannot fill it alone. `put` never blocks: a full
    backlog raises Overloaded at once, which the server turns into 429;
    a request larger than the whole bound is a ValueError (it could never
    be admitted). `remove` lets abort drop a queued request before it costs a
    prefill.
    """

    def __init__(self, max_samples: int):
        if max_samples < 1:
            raise ValueError(f"max_queued_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._jobs: deque[Job] = deque()
        self._samples = 0
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def samples(self) -> int:
        """Samples waiting (each queued request counts its n)."""
        return self._samples

    def put(self, job: Job) -> None:
        n = job.request.n
        if n > self.max_samples:
            raise ValueError(
                f"n={n} is more samples than the whole admission queue holds "
                f"(max_queued_samples={self.max_samples})"
            )
        with self._cond:
            if self._samples + n > self.max_samples:
                raise Overloaded(self._samples)
            self._jobs.append(job)
            self._samples += n
            self._cond.notify()

    def get(self, stop: threading.Event) -> Job | None:
        with self._cond:
            while not self._jobs:
                if stop.is_set():
                    return None
                self._cond.wait(POLL_S)
            job = self._jobs.popleft()
            self._samples -= job.request.n
            return job

    def take_while(self, accept: Callable[[Job], bool]) -> list[Job]:
        """Pop waiting jobs from the head, in order, while `accept` says yes (never blocks)."""
        taken: list[Job] = []
        with self._cond:
            while self._jobs and accept(self._jobs[0]):
                job = self._jobs.popleft()
                self._samples -= job.request.n
                taken.append(job)
        return taken

    def remove(self, job: Job) -> bool:
        """Take a job out if it is still waiting; False if prefill already has it."""
        with self._cond:
            for i, waiting in enumerate(self._jobs):
                if waiting is job:
                    del self._jobs[i]
                    self._samples -= job.request.n
                    return True
        return False

    def clear(self) -> list[Job]:
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
            self._samples = 0
            return jobs


class StepClock:
    """Decode steps as the generate stage dispatches them, for the prefill stage to wait on.

    Between two chunks of a long prompt the prefill stage waits for one decode
    step dispatched after its chunk finished, and for that step's tokens, so
    running streams get a step per chunk instead of waiting out the whole
    prompt. Written by the generate thread only.
    """

    WAIT_S = 1.0  # a chunk never waits longer for a step than this

    def __init__(self, prefill_first: bool = True) -> None:
        """`prefill_first`: a decode step waits for the prefill calls dispatched before it
        (False where prefill has devices of its own)."""
        self._cond = threading.Condition()
        self._steps = 0
        self._busy = False
        self._tokens: object = None
        self._prefill_first = prefill_first
        self._prefills: list[object] = []

    def prefilled(self, outputs: object) -> None:
        """A prefill call was dispatched; `outputs` are its (device) results. Written by the
        prefill thread."""
        if self._prefill_first:
            with self._cond:
                self._prefills.append(outputs)

    def wait_prefills(self) -> None:
        """Before a decode step: wait for the prefill calls dispatched so far (generate thread).

        On shared cores a prefill call and decode steps run at once and the prefill gets
        about half of them, so under a burst the prompts prefilled later waited for their
        first token behind every step of the ones before (a burst of 32 on the 70m-128k
        model: TTFT p50 1.26 s). A step held back until the prefills before it are done
        gives them the device; prefills dispatched after it still overlap it.
        """
        with self._cond:
            pending, self._prefills = self._prefills, []
        if pending:
            jax.block_until_ready(pending)

    def stepped(self, tokens: object) -> None:
        """A step was dispatched; `tokens` is its (device) output."""
        with self._cond:
            self._steps += 1
            self._busy = True
            self._tokens = tokens
            self._cond.notify_all()

    def busy(self) -> None:
        """A slot was filled: a step is coming, so a chunk waits for it (before the first
        step of a batch, a chunk that found decoding idle went on at once, and the first
        chunks of a long prompt ran back to back)."""
        with self._cond:
            self._busy = True

    def idle(self) -> None:
        """No slot is busy: nobody waits for a step that will not come."""
        with self._cond:
            if self._busy:
                self._busy = False
                self._cond.notify_all()

    def let_one_through(self, stop: threading.Event) -> None:
        """Wait for the next decode step and its tokens, unless decoding is idle."""
        with self._cond:
            start = self._steps
            self._cond.wait_for(
                lambda: self._steps > start or not self._busy or stop.is_set(), self.WAIT_S
            )
            tokens = self._tokens if self._steps > start else None
        if tokens is not None:
            jax.block_until_ready(tokens)
