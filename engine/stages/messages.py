"""What crosses between the orchestrator's stages; one declared type per queue.

admission queue:   Job
generate inbox:    GenerateMessage = PrefillDone | ReleaseSlot | CancelJob
detokenize queue:  DetokenizeMessage = SlotAssigned | StepTokens

A request's first token (from prefill) rides in SlotAssigned and its later
tokens in StepTokens, both on the one detokenize queue, which hands out
SlotAssigned ahead of queued steps: a sample's first token still comes before
its later ones (they ride in steps put after it), and older steps are told
apart by their numbers. A slot is named by a lease: a number the generate stage
gives each insertion, so a stale message about a slot's previous occupant
can never touch the next one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from engine.request import ActiveRequest, RequestStream
from engine.types import Prefix, SamplingParams, StepOutput, TokenLogprobs

NO_LEASE = -1  # an idle slot in StepTokens.leases


@dataclass(frozen=True, eq=False)
class Job:
    """One admitted request as every stage sees it; identity is the object itself.

    `cancelled` is the only field that changes: set once by abort, drain or
    failure, read by stages at their hand-off points to drop the job's work.
    """

    request: ActiveRequest
    stream: RequestStream
    samplings: tuple[SamplingParams, ...]  # one per sample, each with its own seed
    max_new_tokens: int  # max_tokens capped by the room left in the context
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)


@dataclass(frozen=True)
class PrefillDone:
    """Sample `index` of a job is prefilled and waits for a free slot."""

    job: Job
    index: int
    prefix: Prefix


@dataclass(frozen=True)
class ReleaseSlot:
    """The detokenize stage is done with a slot; free it if the lease still holds it."""

    slot: int
    lease: int


@dataclass(frozen=True)
class CancelJob:
    """Drop a job's pending prefixes and free its slots (abort, drain timeout).

    Names the Job object, not its id: a new request may reuse the id at once.
    """

    job: Job


GenerateMessage = PrefillDone | ReleaseSlot | CancelJob


@dataclass(frozen=True)
class SlotAssigned:
    """Sample `index` of a job now holds `slot` under `lease`; carries its first token.

    The token fields are the Prefix's device values, copied to the host by the
    detokenize stage, not by the generate thread. `last`: the sample's token
    budget ends with this token (the generate stage alone counts budgets). `done`: the
    sample's structured-output constraint is complete with this token, so it ends "stop".
    """

    slot: int
    lease: int
    job: Job
    index: int
    token: Any
    logprob: Any
    top_ids: Any
    top_logprobs: Any
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None
    last: bool = False
    done: bool = False
    first_step: int = 0  # the number of the first StepTokens that holds this sample


@dataclass(frozen=True)
class StepTokens:
    """One generate step; leases[slot] says whose token each slot holds (NO_LEASE: idle).

    `last` names the slots whose sample used its token budget with this step's
    token; the generate stage has freed them already, and the detokenize stage
    ends those samples with "length" unless another rule ended them first. `done` names
    the slots whose structured-output constraint this step's token completed: those end
    with "stop" (the generate stage frees them before the next step).
    """

    output: StepOutput
    leases: tuple[int, ...]
    last: frozenset[int] = frozenset()
    done: frozenset[int] = frozenset()
    step: int = 0  # steps are numbered from 0 in dispatch order


DetokenizeMessage = SlotAssigned | StepTokens
