"""The orchestrator: continuous batching of ActiveRequests over an engine's slots.

Runs on: the caller's threads (submit, abort, drain, stats) and starts one
thread per stage (engine/stages/): prefill -> generate -> detokenize, with
bounded queues between them. Owns: the registry of open requests, the
admission queue and the lifecycle (running, draining, stopped, dead).

Disaggregated mode (`prefill_engine` given: prefill and generate engines on
their own devices, each with its own params) adds a transfer stage between
prefill and generate: it is the prefill stage's PrefixSink, moves each
Prefix's KV to the generate devices and forwards the PrefillDone to the
generate inbox (its backlog is a queue-depth gauge). A long prompt's chunks
then do not wait for decode steps: the devices are not shared. With shared
devices (the default) there is no transfer stage.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.request import (
    ActiveRequest,
    Overloaded,
    RequestFailed,
    RequestRejected,
    RequestStream,
    Unavailable,
    sample_samplings,
)
from engine.stages.detokenize import DetokenizeStage, TextStreamFactory
from engine.stages.faults import Fault, FaultPlan
from engine.stages.generate import GenerateStage
from engine.stages.messages import (
    CancelJob,
    DetokenizeMessage,
    GenerateMessage,
    Job,
    SlotAssigned,
)
from engine.stages.prefill import PrefillStage, PrefixSink
from engine.stages.queues import AdmissionQueue, Credits, FirstTokensAhead, StepClock
from engine.stages.transfer import TransferStage
from engine.types import CacheStats, EngineProtocol

__all__ = [
    "Orchestrator",
    "OrchestratorConfig",
    "OrchestratorStats",
    "Overloaded",
    "RequestFailed",
    "Unavailable",
]

logger = logging.getLogger(__name__)

_JOIN_S = 5.0
_RATE_WINDOW = 64  # samples whose end times estimate the service rate for Retry-After
_MAX_RETRY_AFTER_S = 60.0  # clients (the openai SDK among them) ignore longer waits


@dataclass(frozen=True)
class OrchestratorConfig:
    max_queued_samples: int = 256  # admission bound in samples; beyond it submit raises Overloaded
    # Prefilled samples waiting for a slot (device memory). At least a full prefill batch
    # (EngineConfig.max_prefill_batch, 16): with 4, half of a batch of 8 waited for the
    # generate stage to insert the other half before the next prompts could be prefilled.
    prefill_queue_size: int = 16
    # Generate steps the detokenize stage may lag behind. A new sample's first token goes
    # ahead of them (FirstTokensAhead); its insert still runs on the device after them.
    detokenize_queue_size: int = 2
    fault_injection: str | None = None  # test hook: "prefill" | "generate" | "detokenize",
    # optionally "stage:after=N" (raise on the (N+1)-th unit of work)

    def __post_init__(self) -> None:
        for name in ("max_queued_samples", "prefill_queue_size", "detokenize_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fault_injection is not None:
            FaultPlan.parse(self.fault_injection)


@dataclass(frozen=True)
class OrchestratorStats:
    """A snapshot of gauges; each field is read without stopping the stages."""

    queued_requests: int  # admitted, waiting for prefill
    prefill_queue_depth: int  # prefilled samples waiting for a slot (transfer included)
    detokenize_queue_depth: int  # messages the detokenize stage has not read yet
    running_requests: int  # admitted and past the admission queue, not yet ended
    slots_in_use: int
    max_slots: int
    alive: bool
    draining: bool
    generate_steps: int = 0
    cache: CacheStats = CacheStats()
    transfer_queue_depth: int | None = None  # disaggregated: samples waiting to be moved


class Orchestrator:
    def __init__(
        self,
        engine: EngineProtocol,
        text_streams: TextStreamFactory,
        config: OrchestratorConfig | None = None,
        prefill_engine: EngineProtocol | None = None,
    ):
        """`text_streams` makes each sample's text path (engine.stages.detokenize.text_streams);
        `prefill_engine`, when given, prefills on its own devices and `engine` only generates."""
        self.config = config or OrchestratorConfig()
        self._engine = engine
        self._prefill_engine = engine if prefill_engine is None else prefill_engine
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a job leaves the registry
        self._jobs: dict[str, Job] = {}
        self._stop = threading.Event()
        self._dead = threading.Event()
        self._error: BaseException | None = None
        self._started = False
        self._draining = False
        self._stopped = False
        self._listeners: list[Callable[[BaseException], None]] = []
        self._threads: list[threading.Thread] = []
        self._sample_ends: deque[float] = deque(maxlen=_RATE_WINDOW)  # under _lock

        plan = (
            None
            if self.config.fault_injection is None
            else FaultPlan.parse(self.config.fault_injection)
        )
        self._admission = AdmissionQueue(self.config.max_queued_samples)
        self._credits = Credits(self.config.prefill_queue_size)
        self._generate_inbox: queue.Queue[GenerateMessage] = queue.Queue()
        self._detokenize_inbox: FirstTokensAhead[DetokenizeMessage] = FirstTokensAhead(
            self.config.detokenize_queue_size, lambda m: isinstance(m, SlotAssigned)
        )
        clock = StepClock()
        self._transfer: TransferStage | None = None
        sink: PrefixSink = self._generate_inbox
        if prefill_engine is not None:
            self._transfer = TransferStage(
                engine, self._generate_inbox, self._credits, self._stop, Fault("transfer", plan)
            )
            sink = self._transfer
        self._prefill = PrefillStage(
            self._prefill_engine,
            self._admission,
            sink,
            self._credits,
            self._stop,
            reject=self._reject,
            fault=Fault("prefill", plan),
            clock=clock if prefill_engine is None else StepClock(shared=False),
        )
        self._generate = GenerateStage(
            engine,
            self._generate_inbox,
            self._detokenize_inbox,
            self._credits,
            self._stop,
            fault=Fault("generate", plan),
            clock=clock,
            reject=self._reject,
        )
        self._detokenize = DetokenizeStage(
            self._detokenize_inbox,
            self._generate_inbox,
            self._stop,
            fault=Fault("detokenize", plan),
            new_text_stream=text_streams,
            on_done=self._job_done,
        )

    # lifecycle

    def start(self) -> None:
        with self._lock:
            if self._started:
                raise RuntimeError("the orchestrator was already started")
            self._started = True
        stages = [("prefill", self._prefill.run)]
        if self._transfer is not None:
            stages.append(("transfer", self._transfer.run))
        stages += [("generate", self._generate.run), ("detokenize", self._detokenize.run)]
        for name, run in stages:
            thread = threading.Thread(
                target=self._run_stage, args=(name, run), name=f"orchestrator-{name}"
            )
            thread.daemon = True
            self._threads.append(thread)
            thread.start()
        logger.info(
            "orchestrator started: %d slots, admission bound %d",
            self._engine.max_slots,
            self.config.max_queued_samples,
        )

    def drain(self, timeout: float) -> bool:
        """Stop admitting, let open requests finish for up to `timeout` s, then stop the stages.

        Returns True if every open request finished in time; the others fail
        with RequestFailed.
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            self._draining = True
            while self._jobs and not self._dead.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(min(remaining, 0.1))
            drained = not self._jobs and self._error is None
            left = len(self._jobs)
        if not drained:
            logger.warning("drain ended with %d requests still open; failing them", left)
        self.stop()
        return drained

    def stop(self) -> None:
        """Stop the stages now; requests still open fail with RequestFailed."""
        with self._lock:
            self._stopped = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._idle.notify_all()
        for job in jobs + self._admission.clear():
            job.cancelled.set()
            job.stream.close(error=RequestFailed("the server stopped before the request finished"))
        self._stop.set()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(_JOIN_S)
        self._engine.close()  # after the stages' last call
        if self._prefill_engine is not self._engine:
            self._prefill_engine.close()

    @property
    def alive(self) -> bool:
        """False once a stage has failed (health reads this)."""
        return self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call `listener(error)` once, from the failing thread, when a stage fails."""
        with self._lock:
            if self._error is None:
                self._listeners.append(listener)
                return
            error = self._error
        listener(error)

    def wait_dead(self, timeout: float | None = None) -> bool:
        """Block until a stage has failed; True if it did within `timeout`."""
        return self._dead.wait(timeout)

    # requests

    def submit(self, request: ActiveRequest) -> RequestStream:
        """Admit a request; its stream yields deltas in order until all n samples end."""
        job = self._new_job(request)
        with self._lock:
            if not self._started or self._stopped or self._error is not None:
                raise Unavailable(self._unavailable_reason())
            if self._draining:
                raise Unavailable("the server is shutting down")
            if request.request_id in self._jobs:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            try:
                self._admission.put(job)
            except Overloaded as exc:
                raise Overloaded(exc.queued, self._retry_after_s(exc.queued)) from None
            self._jobs[request.request_id] = job
        return job.stream

    def _retry_after_s(self, backlog: int) -> float:
        """How long the backlog takes to drain at the rate samples ended lately (lock held)."""
        ends = self._sample_ends
        if len(ends) >= 2 and ends[-1] > ends[0]:
            rate = (len(ends) - 1) / (ends[-1] - ends[0])
        else:  # nothing measured yet: a guess of one second per round of slots
            rate = float(self._engine.max_slots)
        return min(_MAX_RETRY_AFTER_S, max(1.0, backlog / rate))

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; no-op for an unknown or finished one. Thread-safe."""
        with self._lock:
            job = self._jobs.pop(request_id, None)
            if job is None:
                return
            job.cancelled.set()
            self._idle.notify_all()
        if not self._admission.remove(job):
            self._generate_inbox.put(CancelJob(job))
        job.stream.close(aborted=True)

    def stats(self) -> OrchestratorStats:
        queued = len(self._admission)
        return OrchestratorStats(
            queued_requests=queued,
            prefill_queue_depth=self._credits.in_use,
            detokenize_queue_depth=self._detokenize_inbox.qsize(),
            running_requests=max(0, len(self._jobs) - queued),
            slots_in_use=self._generate.slots_in_use,
            max_slots=self._engine.max_slots,
            alive=self.alive,
            draining=self._draining,
            generate_steps=self._generate.steps,
            cache=self._prefill_engine.cache_stats(),  # the prefix cache is prefill's
            transfer_queue_depth=None if self._transfer is None else self._transfer.depth,
        )

    # internals

    def _new_job(self, request: ActiveRequest) -> Job:
        max_new = self._engine.limits.check(len(request.prompt_ids), request.max_tokens)
        samplings = sample_samplings(request)
        return Job(request, RequestStream(request.request_id, request.n), samplings, max_new)

    def _job_done(self, job: Job) -> None:
        """All samples of a job ended (detokenize thread): unregister, then end its stream."""
        now = time.monotonic()
        with self._lock:
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]
                self._idle.notify_all()
            self._sample_ends.extend([now] * job.request.n)
        job.stream.close()

    def _reject(self, job: Job, error: Exception) -> None:
        """One request cannot be served (prefill thread; generate thread when its grammar
        refuses a token); the others go on."""
        job.cancelled.set()
        with self._lock:
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]
                self._idle.notify_all()
        self._generate_inbox.put(CancelJob(job))  # samples already prefilled give back slots
        job.stream.close(error=RequestRejected(str(error)))

    def _run_stage(self, name: str, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as exc:
            logger.exception("orchestrator %s stage failed", name)
            self._fail(exc, name)

    def _fail(self, error: BaseException, stage: str) -> None:
        """Fail every open request, mark the orchestrator dead and stop the other stages."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            jobs = list(self._jobs.values())
            self._jobs.clear()
            listeners, self._listeners = self._listeners, []
            self._idle.notify_all()
        self._stop.set()
        failure = RequestFailed(f"the {stage} stage failed: {error!r}")
        for job in jobs:
            job.cancelled.set()
            job.stream.close(error=failure)
        self._admission.clear()
        self._dead.set()
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("orchestrator failure listener raised")

    def _unavailable_reason(self) -> str:
        if self._error is not None:
            return f"the engine failed: {self._error!r}"
        if not self._started:
            return "the engine is not started"
        return "the engine is stopped"
