"""The prefill stage: prompts in, prefilled samples out.

Runs on: the prefill thread. Owns: nothing but its calls into engine.prefill
and engine.resample. Receives: Job (admission queue). Emits: PrefillDone into
its sink, which is the generate inbox when prefill and generate share devices
and would be a transfer stage's inbox in disaggregated mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from engine.stages.faults import Fault
from engine.stages.messages import Job, PrefillDone
from engine.stages.queues import AdmissionQueue, Credits
from engine.types import EngineProtocol

# What the engine raises for a request whose data it cannot take (a prompt too long, an id
# out of the vocabulary, a value that does not convert to its device dtype). The server
# validates first; these only reach here past it, and fail that request alone.
REQUEST_ERRORS = (ValueError, OverflowError)


class PrefixSink(Protocol):
    """Where prefilled samples go next: the generate inbox, or a transfer stage."""

    def put(self, item: PrefillDone) -> None: ...


class PrefillStage:
    def __init__(
        self,
        engine: EngineProtocol,
        admission: AdmissionQueue,
        sink: PrefixSink,
        credits: Credits,
        stop: threading.Event,
        reject: Callable[[Job, Exception], None],
        fault: Fault,
    ):
        self._engine = engine
        self._admission = admission
        self._sink = sink
        self._credits = credits
        self._stop = stop
        self._reject = reject
        self._fault = fault

    def run(self) -> None:
        while not self._stop.is_set():
            job = self._admission.get(self._stop)
            if job is not None and not job.cancelled.is_set():
                self._prefill(job)

    def _prefill(self, job: Job) -> None:
        """Prefill once; n > 1 samples reuse the prompt KV with their own first token."""
        request = job.request
        job.stream.timings.prefill_start = time.monotonic()
        self._fault.tick()
        try:
            prefix = self._engine.prefill(
                request.prompt_ids, job.samplings[0], prompt_logprobs=request.prompt_logprobs
            )
        except REQUEST_ERRORS as exc:  # this request's fault, not the stage's
            self._reject(job, exc)
            return
        job.stream.timings.prefill_end = time.monotonic()
        for index, sampling in enumerate(job.samplings):
            if job.cancelled.is_set() or not self._credits.acquire(self._stop):
                return
            try:
                sample = prefix if index == 0 else self._engine.resample(prefix, sampling)
            except REQUEST_ERRORS as exc:
                self._credits.release()
                self._reject(job, exc)
                return
            self._sink.put(PrefillDone(job, index, sample))
