"""The detokenize stage: token ids in, text deltas out, in order, one sample at a time.

Runs on: the detokenize thread. Owns: each running sample's incremental
detokenizer, stop matcher and token count, and which sample each slot feeds
as the token stream sees it. Receives: SlotAssigned, StepTokens (detokenize
queue). Emits: Delta into request streams; ReleaseSlot to the generate inbox
when a sample ends; a job to `on_done` when all its samples have ended.

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

from engine.request import Delta
from engine.stages.faults import Fault
from engine.stages.messages import (
    DetokenizeMessage,
    GenerateMessage,
    Job,
    ReleaseSlot,
    SlotAssigned,
    StepTokens,
)
from engine.stages.queues import get
from engine.types import TokenLogprobs


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class StopMatch(Protocol):
    text: str
    matched: str | None


class StopMatcher(Protocol):
    def feed(self, text: str) -> StopMatch: ...
    def flush(self) -> str: ...


DetokenizerFactory = Callable[[tuple[int, ...], bool], Detokenizer]  # (prompt ids, skip special)
StopMatcherFactory = Callable[[tuple[str, ...], bool], StopMatcher]  # (stop, include stop str)


@dataclass
class _Sample:
    """Text state of one running sample; lives only on the detokenize thread."""

    job: Job
    index: int
    slot: int
    lease: int
    detokenizer: Detokenizer
    matcher: StopMatcher | None
    completion_tokens: int = 0


@dataclass(frozen=True)
class _Token:
    token_id: int
    logprobs: TokenLogprobs | None


class DetokenizeStage:
    def __init__(
        self,
        inbox: queue.Queue[DetokenizeMessage],
        generate_inbox: queue.Queue[GenerateMessage],
        stop: threading.Event,
        fault: Fault,
        *,
        eos_token_ids: Collection[int],
        new_detokenizer: DetokenizerFactory,
        new_stop_matcher: StopMatcherFactory,
        on_done: Callable[[Job], None],
    ):
        self._inbox = inbox
        self._generate_inbox = generate_inbox
        self._stop = stop
        self._fault = fault
        self._eos = frozenset(eos_token_ids)
        self._new_detokenizer = new_detokenizer
        self._new_stop_matcher = new_stop_matcher
        self._on_done = on_done
        self._by_slot: dict[int, _Sample] = {}
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
            detokenizer=self._new_detokenizer(request.prompt_ids, request.skip_special_tokens),
            matcher=(
                self._new_stop_matcher(request.stop, request.include_stop_str_in_output)
                if request.stop
                else None
            ),
        )
        previous = self._by_slot.get(message.slot)
        if previous is not None:  # the generate stage reused a slot of a cancelled job
            if not previous.job.cancelled.is_set():
                raise RuntimeError(f"slot {message.slot} reassigned while still running")
            self._drop(previous)
        self._by_slot[message.slot] = sample
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
        self._advance(sample, _Token(token_id, logprobs), message.prompt_logprobs)

    def _on_step(self, message: StepTokens) -> None:
        live: list[_Sample] = []
        for slot, sample in list(self._by_slot.items()):
            if sample.job.cancelled.is_set():
                self._drop(sample)
            elif message.leases[slot] != sample.lease:
                raise RuntimeError(
                    f"slot {slot} of running request {sample.job.request_id} was freed early"
                )
            else:
                live.append(sample)
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
            self._advance(sample, _Token(token_id, logprobs), None)

    def _advance(
        self,
        sample: _Sample,
        token: _Token,
        prompt_logprobs: tuple[TokenLogprobs | None, ...] | None,
    ) -> None:
        """Turn one token into a delta; finish the sample on EOS, stop or length."""
        job, request = sample.job, sample.job.request
        sample.completion_tokens += 1
        may_stop = sample.completion_tokens >= job.samplings[sample.index].min_tokens
        finish: str | None = None
        stop_reason: str | int | None = None
        text = ""
        if may_stop and token.token_id in request.stop_token_ids:
            finish, stop_reason = "stop", token.token_id
        elif may_stop and not request.ignore_eos and token.token_id in self._eos:
            finish = "stop"
        else:
            text = sample.detokenizer.add(token.token_id)
            if sample.matcher is not None:
                match = sample.matcher.feed(text)
                text = match.text
                if match.matched is not None:
                    finish, stop_reason = "stop", match.matched
        if finish is None and sample.completion_tokens >= job.max_new_tokens:
            finish = "length"
        if finish is not None and not isinstance(stop_reason, str):
            tail, matched = self._flush(sample)
            text += tail
            if matched is not None:
                finish, stop_reason = "stop", matched
        now = time.monotonic()
        timings = job.stream.timings
        if timings.first_token is None:
            timings.first_token = now
        job.stream.push(
            Delta(
                index=sample.index,
                text=text,
                token_ids=(token.token_id,),
                logprobs=None if token.logprobs is None else (token.logprobs,),
                finish_reason=finish,
                stop_reason=stop_reason,
                prompt_tokens=job.prompt_tokens,
                completion_tokens=sample.completion_tokens,
                prompt_logprobs=prompt_logprobs,
                emitted=now,
            )
        )
        if finish is not None:
            self._finish(sample)

    def _flush(self, sample: _Sample) -> tuple[str, str | None]:
        """Text held back by the detokenizer and the stop matcher, and a stop string it ends."""
        tail = sample.detokenizer.flush()
        if sample.matcher is None:
            return tail, None
        match = sample.matcher.feed(tail)
        if match.matched is not None:
            return match.text, match.matched
        return match.text + sample.matcher.flush(), None

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
        if self._by_slot.get(sample.slot) is sample:
            del self._by_slot[sample.slot]
        self._generate_inbox.put(ReleaseSlot(sample.slot, sample.lease))


def _token_logprobs(
    k: int, token_id: int, logprob: Any, top_ids: Any, top_logprobs: Any
) -> TokenLogprobs:
    top = tuple((int(i), float(p)) for i, p in zip(top_ids[:k], top_logprobs[:k], strict=True))
    return TokenLogprobs(token_id=token_id, logprob=float(logprob), top=top)
