"""The input step: an ActiveRequest becomes the one message the core is sent for it.

Runs on: the submitting thread. Owns: seeding (a request without a seed draws one; its
n samples' seeds follow from it) and the AddRequest it becomes. Receives an
ActiveRequest; emits the samples' SamplingParams (for the output processor) and the
AddRequest. Checks nothing: the server checked the request at the edge, the core checks
it again where its rules are enforced (engine.core.loop).
"""

from __future__ import annotations

import dataclasses
import secrets

from engine.core.messages import AddRequest, Grammar, Sample
from engine.types import SamplingParams
from frontend.request import ActiveRequest

SEED_STRIDE = 1_000_003  # seeds of samples 1..n-1: request seed + index * stride, wrapped


def sample_samplings(request: ActiveRequest) -> tuple[SamplingParams, ...]:
    """Each of the request's n samples' sampling, seeded: a request without a seed draws
    one; sample i takes seed + i * SEED_STRIDE, kept in the signed 64-bit range."""
    sampling = request.sampling
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    return tuple(
        dataclasses.replace(sampling, seed=(seed + i * SEED_STRIDE + 2**63) % 2**64 - 2**63)
        for i in range(request.n)
    )


def add_request(request: ActiveRequest, samplings: tuple[SamplingParams, ...]) -> AddRequest:
    """The message the core gets: token ids, seeded samples, and what the core's token
    rules read (the budget, the request's stop ids, ignore_eos; the EOS set is the core's)."""
    return AddRequest(
        request_id=request.request_id,
        prompt=tuple(request.prompt_ids),
        samples=tuple(Sample.of(s) for s in samplings),
        max_tokens=request.max_tokens,
        stop_token_ids=tuple(sorted(set(request.stop_token_ids))),
        ignore_eos=request.ignore_eos,
        prompt_logprobs=_prompt_logprobs(request),
        grammar=_grammar(request.sampling),
        lora=request.lora,
    )


def _prompt_logprobs(request: ActiveRequest) -> int | None:
    """Alternatives per prompt position: vLLM's prompt_logprobs k; the old echo flag asks
    for as many as the request's logprobs."""
    asked: object = request.prompt_logprobs
    if asked is None or asked is False:
        return None
    if asked is True:
        return request.sampling.logprobs or 0
    return int(asked)  # type: ignore[call-overload]


def _grammar(sampling: SamplingParams) -> Grammar | None:
    constraint = sampling.constraint
    if constraint is None:
        return None
    kind, text = constraint.spec
    return Grammar(kind, text)
