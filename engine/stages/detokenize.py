"""The detokenize stage: token ids in, text deltas out, in order, one sample at a time.

Runs on: the detokenize thread. Owns: each running sample's text stream
(tokenization.TextStream: its detokenizer, stop matcher, token count and the
rules that end it), and which lease (slot occupancy) feeds each sample.
A first token (SlotAssigned) arrives ahead of the steps queued before it
(engine.stages.queues.FirstTokensAhead), so steps numbered before a sample's
first step may still come, carrying the slot's previous occupant (or none):
a sample takes tokens only from its own steps, found by step number and lease.
Receives: SlotAssigned, StepTokens (detokenize queue). Emits: Delta into
request streams; ReleaseSlot to the generate inbox when a sample ends; a job
to `on_done` when all its samples have ended.

This is where device values become host values (np.asarray), so the
generate thread never waits on a copy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.request import ActiveRequest, Delta
from engine.stages.faults import Fault
from engine.stages.messages import (
    DetokenizeMessage,
    GenerateMessage,
    Job,
    ReleaseSlot,
    SlotAssigned,
    StepTokens,
)
from engine.stages.queues import Channel, get
from engine.types import SamplingParams, TokenLogprobs


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TextStep(Protocol):
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> str | int | None: ...


class TextStream(Protocol):
    """One sample's text path (tokenization.TextStream): every rule that ends a sample."""

    tokens: int  # tokens consumed so far

    def add(self, token_id: int, *, last: bool = False, done: bool = False) -> TextStep: ...


TextStreamFactory = Callable[[ActiveRequest, SamplingParams], TextStream]
DetokenizerFactory = Callable[[tuple[int, ...], bool], Detokenizer]  # (prompt ids, skip special)


def text_streams(
    new_detokenizer: DetokenizerFactory, eos_token_ids: Collection[int]
) -> TextStreamFactory:
    """A factory of tokenization.TextStream over `new_detokenizer`, with these EOS ids."""
    from tokenization.stream import TextStream as Stream

    eos = frozenset(eos_token_ids)

    def new(request: ActiveRequest, sampling: SamplingParams) -> TextStream:
        stream: TextStream = Stream(
            new_detokenizer(request.prompt_ids, request.skip_special_tokens),
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            eos_token_ids=() if request.ignore_eos else eos,
            min_tokens=sampling.min_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        return stream

    return new


@dataclass
class _Sample:
    """Text state of one running sample; lives only on the detokenize thread."""

    job: Job
    index: int
    slot: int
    lease: int
    first_step: int  # the first generate step that holds its tokens
    text: TextStream


@dataclass(frozen=True)
class _Token:
    token_id: int
    logprobs: TokenLogprobs | None


class DetokenizeStage:
    def __init__(
        self,
        inbox: Channel[DetokenizeMessage],
        generate_inbox: queue.Queue[GenerateMessage],
        stop: threading.Event,
        fault: Fault,
        *,
        new_text_stream: TextStreamFactory,
        on_done: Callable[[Job], None],
    ):
        self._inbox = inbox
        self._generate_inbox = generate_inbox
        self._stop = stop
        self._fault = fault
        self._new_text_stream = new_text_stream
        self._on_done = on_done
        self._by_lease: dict[int, _Sample] = {}
        self._samples_left: dict[Job, int] = {}

    def run(self) -> None:
        handlers = {SlotAssigned: self._on_assigned, StepTokens: self._on_step}
        while not self._stop.is_set():
            message = get(self._inbox, self._stop)
            if message is not None:
                self._fault.tick()
                handlers[type(message)](message)  # type: ignore[operator]

    def _on_assigned(self, message: SlotAssigned) -> None:
        job = message.job
        request = job.request
        sample = _Sample(
            job=job,
            index=message.index,
            slot=message.slot,
            lease=message.lease,
            first_step=message.first_step,
            text=self._new_text_stream(request, job.samplings[message.index]),
        )
        self._by_lease[message.lease] = sample
        self._samples_left.setdefault(job, request.n)
        if job.cancelled.is_set():
            self._drop(sample)
            return
        token_id = int(np.asarray(message.token))
        k = job.samplings[message.index].logprobs
        logprobs = None
        if k is not None:
            logprobs = _token_logprobs(
                k,
                token_id,
                np.asarray(message.logprob),
                np.asarray(message.top_ids),
                np.asarray(message.top_logprobs),
            )
        self._advance(
            sample, _Token(token_id, logprobs), message.prompt_logprobs, message.last, message.done
        )

    def _on_step(self, message: StepTokens) -> None:
        live: list[_Sample] = []
        for sample in list(self._by_lease.values()):
            if sample.job.cancelled.is_set():
                self._drop(sample)
            elif message.step < sample.first_step:
                continue  # dispatched before this sample was inserted: not its token
            elif message.leases[sample.slot] == sample.lease:
                live.append(sample)
            else:
                raise RuntimeError(
                    f"slot {sample.slot} of running request {sample.job.request_id} was freed early"
                )
        if not live:
            return
        output = message.output
        tokens = np.asarray(output.tokens)
        if any(s.job.samplings[s.index].logprobs is not None for s in live):
            logprob = np.asarray(output.logprobs)
            top_ids = np.asarray(output.top_ids)
            top_logprobs = np.asarray(output.top_logprobs)
        for sample in live:
            token_id = int(tokens[sample.slot])
            k = sample.job.samplings[sample.index].logprobs
            logprobs = None
            if k is not None:
                slot = sample.slot
                logprobs = _token_logprobs(
                    k, token_id, logprob[slot], top_ids[slot], top_logprobs[slot]
                )
            slot = sample.slot
            token = _Token(token_id, logprobs)
            self._advance(sample, token, None, slot in message.last, slot in message.done)

    def _advance(
        self,
        sample: _Sample,
        token: _Token,
        prompt_logprobs: tuple[TokenLogprobs | None, ...] | None,
        last: bool,
        done: bool = False,
    ) -> None:
        """Turn one token into a delta; the text stream says whether the sample ended.

        `last` and `done` come from the generate stage, the one counter of token budgets
        and the one reader of structured-output matchers.
        """
        job = sample.job
        step = sample.text.add(token.token_id, last=last, done=done)
        now = time.monotonic()
        if job.stream.timings.first_token is None:
            job.stream.timings.first_token = now
        job.stream.push(
            Delta(
                index=sample.index,
                text=step.text,
                token_ids=(token.token_id,),
                logprobs=None if token.logprobs is None else (token.logprobs,),
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
                prompt_tokens=job.prompt_tokens,
                completion_tokens=sample.text.tokens,
                prompt_logprobs=prompt_logprobs,
                emitted=now,
            )
        )
        if step.finish_reason is not None:
            self._finish(sample)

    def _finish(self, sample: _Sample) -> None:
        self._unbind(sample)
        left = self._samples_left[sample.job] - 1
        if left:
            self._samples_left[sample.job] = left
        else:
            del self._samples_left[sample.job]
            self._on_done(sample.job)

    def _drop(self, sample: _Sample) -> None:
        """Forget a sample of a cancelled job; its stream was closed by whoever cancelled it."""
        self._unbind(sample)
        self._samples_left.pop(sample.job, None)

    def _unbind(self, sample: _Sample) -> None:
        if self._by_lease.get(sample.lease) is sample:
            del self._by_lease[sample.lease]
        self._generate_inbox.put(ReleaseSlot(sample.slot, sample.lease))


def _token_logprobs(
    k: int, token_id: int, logprob: Any, top_ids: Any, top_logprobs: Any
) -> TokenLogprobs:
    top = tuple((int(i), float(p)) for i, p in zip(top_ids[:k], top_logprobs[:k], strict=True))
    return TokenLogprobs(token_id=token_id, logprob=float(logprob), top=top)
