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

    def acquire(self, stop: threading.Event, before_wait: Callable[[], None] | None = None) -> bool:
        """Take a credit, waiting for one; False if the orchestrator stopped first.
        `before_wait` runs first if there is none to take at once."""
        with self._cond:
            if self._in_use < self.limit:
                self._in_use += 1
                return True
        if before_wait is not None:
            before_wait()
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
    """Turns between prefill calls and decode steps on the devices they share.

    While prompts wait, prefill calls and decode steps take turns: a call starts
    once the decode step dispatched after the previous call ended has finished (at
    once when nothing decodes), and no step is dispatched while a call runs, or
    waits with its step already dispatched. So a running stream waits out at most
    one prefill call per token (vLLM's one token budget per scheduler step: a call
    takes at most max_prefill_batch_tokens), and a call never shares the cores with
    steps: under a burst of 32 prompts on the 70m-128k model a batch of 16 took
    73 ms alone and 122-134 ms beside the small steps of the prompts before it,
    which each pay the whole vocabulary product for a few rows.

    A long prompt's calls (its chunks) run beside the steps instead (`hold` False),
    with one step between two of them: held for each chunk, streams on the 100m
    model waited out ~1 s chunks of 512 tokens (inter-token p99 45x their p50);
    beside them they go on at about half speed. Where prefill has devices of its
    own (`shared=False`) nobody waits.

    Written by the prefill thread (`prefill_turn`, `prefill_ended`) and the generate
    thread (`busy`, `idle`, `begin_step`, `stepped`).
    """

    WAIT_S = 1.0  # a prefill call never waits longer for its step than this

    def __init__(self, shared: bool = True) -> None:
        self._cond = threading.Condition()
        self._shared = shared
        self._claimed = 0  # steps the generate thread has begun
        self._dispatched = 0  # ... and dispatched; _tokens is the last one's output
        self._tokens: object = None
        self._busy = False
        self._prefill = "idle"  # "waiting" for its step, "running" (steps held), "beside"
        self._mark = 0  # steps begun when the last prefill call ended
        self.calls_ended = 0  # prefill calls ended so far (read by the generate thread)

    # -- prefill thread --------------------------------------------------------------------

    def prefill_turn(self, stop: threading.Event, hold: bool = True) -> None:
        """Before a prefill call: wait for the step owed to the running streams, if any.
        `hold` False: the call runs beside the steps (a long prompt's chunks, see
        PrefillStage), which then get one step between two of its calls."""
        if not self._shared:
            return
        with self._cond:
            self._prefill = "waiting"
            self._cond.wait_for(
                lambda: (
                    not self._busy
                    or stop.is_set()
                    or self._dispatched == self._claimed > self._mark
                ),
                self.WAIT_S,
            )
            self._prefill = "running" if hold else "beside"
            self._cond.notify_all()  # beside: the steps held while it waited go on
            tokens = self._tokens if self._dispatched > self._mark else None
        if tokens is not None:
            jax.block_until_ready(tokens)

    def prefill_ended(self) -> None:
        """The call is done (its outputs waited for): steps may go again. Idempotent."""
        with self._cond:
            if self._prefill != "idle":
                self._prefill = "idle"
                self._mark = self._claimed
                self.calls_ended += 1
                self._cond.notify_all()

    # -- generate thread -------------------------------------------------------------------

    def begin_step(self, stop: threading.Event, calls_ended: int | None = None) -> bool:
        """Right before dispatching a step: True, and the step is counted. False while a
        prefill call has the turn (after waiting up to POLL_S for it to end), or when a
        call ended since the caller read `calls_ended` (before taking in its inbox): the
        caller then takes in what the call handed on, so it rides in this step, and asks
        again."""
        with self._cond:
            if self._held():
                self._cond.wait_for(lambda: not self._held() or stop.is_set(), POLL_S)
                return False
            if calls_ended is not None and calls_ended != self.calls_ended:
                return False
            self._claimed += 1
            return True

    def _held(self) -> bool:
        return self._prefill == "running" or (
            self._prefill == "waiting" and self._claimed > self._mark
        )

    def stepped(self, tokens: object) -> None:
        """The step begun last was dispatched; `tokens` is its (device) output."""
        with self._cond:
            self._dispatched = self._claimed
            self._busy = True
            self._tokens = tokens
            self._cond.notify_all()

    def busy(self) -> None:
        """A slot was filled: a step is coming, so a prefill call waits for it (a call
        that found decoding idle before the first step of a batch went on at once)."""
        with self._cond:
            self._busy = True

    def idle(self) -> None:
        """No slot is busy: nobody waits for a step that will not come."""
        with self._cond:
            if self._busy:
                self._busy = False
                self._cond.notify_all()
