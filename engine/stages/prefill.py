"""The prefill stage: prompts in, prefilled samples out.

Runs on: the prefill thread. Owns: nothing but its calls into engine.prefill,
engine.prefill_batch and engine.resample. Prompts waiting together are
prefilled in one call, as many as the engine says fit one of its compiled
(batch, length) shapes; a prompt longer than the largest bucket is prefilled
in chunks. Calls take turns with decode steps (StepClock).
Receives: Job (admission queue). Emits: PrefillDone into
its sink, which is the generate inbox when prefill and generate share devices
and would be a transfer stage's inbox in disaggregated mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import jax

from engine.stages.faults import Fault
from engine.stages.messages import Job, PrefillDone
from engine.stages.queues import AdmissionQueue, Credits, StepClock
from engine.types import EngineProtocol, Prefix

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
        clock: StepClock | None = None,
    ):
        self._engine = engine
        self._clock = clock if clock is not None else StepClock()
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
                self._prefill(self._gather(job))

    def _gather(self, first: Job) -> list[Job]:
        """`first` and the jobs queued right behind it that fit one prefill call with it.

        A prompt that starts with cached blocks is prefilled alone: a batched call looks
        nothing up, and computing only the rest on top of the cache costs less."""
        if self._alone(first):
            return [first]
        lengths = [len(first.request.prompt_ids)]

        def fits(waiting: Job) -> bool:
            together = [*lengths, len(waiting.request.prompt_ids)]
            if self._alone(waiting) or not self._engine.batch_fits(together):
                return False
            lengths.append(together[-1])
            return True

        return [first, *self._admission.take_while(fits)]

    def _alone(self, job: Job) -> bool:
        """Prompt logprobs need every position's logits; a prefix-cache hit its lookup."""
        request = job.request
        return (
            request.prompt_logprobs is not None
            or self._engine.cached_tokens(request.prompt_ids) > 0
        )

    def _prefill(self, batch: list[Job]) -> None:
        """Prefill the batch in one engine call, in its turn (StepClock); a request's bad
        data fails it alone."""
        started = time.monotonic()
        for job in batch:
            job.stream.timings.prefill_start = started
            self._fault.tick()
        # one call holds the steps for its duration; a long prompt's calls run beside them
        long = len(batch) == 1 and self._engine.prefill_parts(batch[0].request.prompt_ids) > 1
        self._clock.prefill_turn(self._stop, hold=not long)
        try:
            self._call(batch)
        finally:
            self._clock.prefill_ended()

    def _call(self, batch: list[Job]) -> None:
        try:
            if len(batch) == 1:
                request = batch[0].request
                prefixes = [
                    self._engine.prefill(
                        request.prompt_ids,
                        batch[0].samplings[0],
                        prompt_logprobs=request.prompt_logprobs,
                        between_chunks=self._between_chunks,
                    )
                ]
            else:
                prompts = [(job.request.prompt_ids, job.samplings[0]) for job in batch]
                prefixes = self._engine.prefill_batch(prompts)
        except REQUEST_ERRORS as exc:  # this request's fault (or one of the batch's)
            self._clock.prefill_ended()
            if len(batch) == 1:
                self._reject(batch[0], exc)
            else:  # find which: each alone
                for job in batch:
                    self._prefill([job])
            return
        # Wait for the call before taking the next prompts: the ones arriving meanwhile then
        # make one batch. Dispatching on at once, a burst that trickled in over HTTP went
        # out as many calls of 1-2 prompts (a burst of 32 on the 70m-128k model: TTFT p50
        # ~1.3 s in some runs, ~0.55 s in others).
        jax.block_until_ready([prefix.token for prefix in prefixes])
        ended = time.monotonic()
        for job, prefix in zip(batch, prefixes, strict=True):
            job.stream.timings.prefill_end = ended
            self._hand_on(job, prefix)

    def _between_chunks(self) -> None:
        """A long prompt's chunks take turns with decode steps of the running streams."""
        self._fault.tick()
        self._clock.prefill_ended()
        self._clock.prefill_turn(self._stop, hold=False)

    def _hand_on(self, job: Job, prefix: Prefix) -> None:
        """Every sample of the job to the sink; n > 1 reuse the prompt KV, new first tokens."""
        for index, sampling in enumerate(job.samplings):
            # The samples reach the generate stage before its steps may go on (they then
            # ride in the next one), unless that would mean waiting for a slot.
            if job.cancelled.is_set() or not self._credits.acquire(
                self._stop, before_wait=self._clock.prefill_ended
            ):
                return
            try:
                sample = prefix if index == 0 else self._engine.resample(prefix, sampling)
            except REQUEST_ERRORS as exc:
                self._credits.release()
                self._reject(job, exc)
                return
            self._sink.put(PrefillDone(job, index, sample))
