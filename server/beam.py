"""Beam search through the API, as vLLM's frontend serves it: over ordinary engine requests.

Runs on: the event loop. Owns: vLLM's beam search semantics (server.beam_plan reads the
request's settings). The engine stays unaware: each
step is one greedy request per live beam, its prompt the beam's tokens so far and
`max_tokens` 1, asking for the 2 x width most likely next tokens (logprobs of the raw
logits); the prefix cache serves every step's shared leading blocks. A beam's candidates
are those tokens; an EOS candidate (unless `ignore_eos`) completes the beam, the others
compete, and the `width` best by cumulative logprob go on. After `max_tokens` steps (or
when no beam is left, or with `early_stopping` as soon as `width` beams completed) the
completed and live beams are ranked by cumulative logprob / length ** length_penalty
(length counts the prompt and the generated tokens but EOS, as vLLM's) and the best
`width` are the choices. The EOS token is in a choice's token ids only with
`include_stop_str_in_output`, never in its text.

Receives: a `GenerationPlan` with `beam` set. Emits: one `Delta` per choice into the
endpoint's shaper, so completions and chat format beams as they format samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.types import SamplingParams, TokenLogprobs
from frontend.request import ActiveRequest, Delta
from server.backend import Backend
from server.beam_plan import BeamSettings
from server.generation import Generation, PromptDelta, RequestLog, Shaper
from server.lifecycle import Runtime
from server.metrics import EngineMetrics
from server.params import GenerationPlan, PromptInput


@dataclass(frozen=True)
class Beam:
    """A generated sequence: its tokens (EOS last when it completed), their logprobs (each
    with the step's alternatives) and their sum."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    cum_logprob: float = 0.0
    ended: bool = False  # completed by EOS

    def then(self, step: TokenLogprobs, token: int, logprob: float, ended: bool) -> Beam:
        entry = TokenLogprobs(token, logprob, step.top)
        return Beam(
            self.tokens + (token,), self.logprobs + (entry,), self.cum_logprob + logprob, ended
        )


class BeamSearch:
    """The search over one prompt, without I/O: `expand` with each live beam's step, until
    `over`; then `best`."""

    def __init__(
        self, prompt_len: int, settings: BeamSettings, eos: frozenset[int], max_steps: int
    ) -> None:
        self.settings = settings
        self._prompt_len = prompt_len
        self._max_steps = max_steps
        self._eos = frozenset() if settings.ignore_eos else eos
        self.live: list[Beam] = [Beam()]
        self.done: list[Beam] = []
        self.steps = 0

    @property
    def over(self) -> bool:
        s = self.settings
        stopped_early = s.early_stopping and len(self.done) >= s.width
        return not self.live or self.steps >= self._max_steps or stopped_early

    def expand(self, steps: Sequence[TokenLogprobs]) -> None:
        """One step: `steps[i]` holds live beam i's most likely next tokens, best first."""
        candidates: list[Beam] = []
        for beam, step in zip(self.live, steps, strict=True):
            for token, logprob in step.top:
                grown = beam.then(step, token, logprob, ended=token in self._eos)
                (self.done if grown.ended else candidates).append(grown)
        # a stable sort: ties keep the order of beams, then of each beam's tokens
        candidates.sort(key=lambda b: -b.cum_logprob)
        self.live = candidates[: self.settings.width]
        self.steps += 1

    def score(self, beam: Beam) -> float:
        """vLLM's: cumulative logprob / (prompt + generated tokens but EOS) ** length_penalty."""
        length = self._prompt_len + len(beam.tokens) - (1 if beam.ended else 0)
        return beam.cum_logprob / (length**self.settings.length_penalty)

    def best(self) -> list[Beam]:
        ranked = sorted(self.done + self.live, key=self.score, reverse=True)
        return ranked[: self.settings.width]


async def complete(
    runtime: Runtime,
    backend: Backend,
    plan: GenerationPlan,
    metrics: EngineMetrics,
    log: RequestLog,
    shaper: Shaper,
) -> dict[str, Any]:
    """The whole response of a beam-search plan: each prompt searched (concurrently), its
    best beams folded into `shaper` as the choices; raises APIError as a Generation does."""
    settings = plan.beam
    if settings is None:
        raise ValueError("a beam search needs a plan with beam settings")
    searches = []
    for prompt in plan.prompts:
        steps = settings.max_tokens  # None: as many as the context has room for
        room = backend.limits.max_model_len - len(prompt.ids)
        steps = room if steps is None else min(steps, room)
        searches.append(BeamSearch(len(prompt.ids), settings, backend.eos_token_ids, steps))
    tasks = [
        asyncio.ensure_future(_run(runtime, backend, metrics, request.request_id, prompt, search))
        for request, prompt, search in zip(plan.requests, plan.prompts, searches, strict=True)
    ]
    try:
        await asyncio.gather(*tasks)
    finally:  # one prompt's failure (or the client leaving) stops the others' searches
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
    completion_tokens = 0
    for index, (prompt, search) in enumerate(zip(plan.prompts, searches, strict=True)):
        for choice, beam in enumerate(search.best()):
            delta = as_delta(backend, settings, prompt, choice, beam)
            shaper.apply(PromptDelta(index, delta))
            completion_tokens += len(delta.token_ids)
            log.finish_reasons.append(delta.finish_reason or "length")
    log.prompt_tokens = sum(len(p.ids) for p in plan.prompts)
    log.completion_tokens = completion_tokens
    return shaper.response(completion_tokens)


async def _run(
    runtime: Runtime,
    backend: Backend,
    metrics: EngineMetrics,
    base_id: str,
    prompt: PromptInput,
    search: BeamSearch,
) -> None:
    """Drive one search: each step, one engine request per live beam (a Generation, so
    submission, failures and aborts are a generation's)."""
    sampling = SamplingParams(temperature=0.0, logprobs=2 * search.settings.width)
    while not search.over:
        requests = tuple(
            ActiveRequest(
                request_id=f"{base_id}-step{search.steps}-beam{i}",
                prompt_ids=prompt.ids + beam.tokens,
                sampling=sampling,
                max_tokens=1,
                ignore_eos=True,  # every beam's next-token logprobs, EOS or not
            )
            for i, beam in enumerate(search.live)
        )
        step_plan = GenerationPlan(
            requests=requests,
            prompts=tuple(PromptInput(r.prompt_ids, "") for r in requests),
            n=1,
            stream=False,
            include_usage=False,
        )
        generation = Generation(runtime, backend, step_plan, metrics, RequestLog())
        steps: list[TokenLogprobs | None] = [None] * len(requests)
        try:
            async for item in generation.deltas():
                if item.delta.logprobs:
                    steps[item.prompt_index] = item.delta.logprobs[0]
        finally:
            await generation.close()
        got = [step for step in steps if step is not None]
        if len(got) != len(steps):
            raise RuntimeError("a beam's step came back without its logprobs")
        search.expand(got)


def as_delta(
    backend: Backend, settings: BeamSettings, prompt: PromptInput, index: int, beam: Beam
) -> Delta:
    """A beam as a sample's one and only delta."""
    shown = beam.tokens[:-1] if beam.ended else beam.tokens
    kept = beam.tokens if settings.include_stop_str_in_output else shown
    text = backend.tokenizer.decode(shown, skip_special_tokens=settings.skip_special_tokens)
    return Delta(
        index=index,
        text=text,
        token_ids=kept,
        logprobs=beam.logprobs[: len(kept)],
        finish_reason="stop" if beam.ended else "length",
        stop_reason=beam.tokens[-1] if beam.ended else None,
        prompt_tokens=len(prompt.ids),
        completion_tokens=len(kept),
        emitted=time.monotonic(),
    )
