"""A sequence as the scheduler tracks it, the tokens it emits, and the scheduler's bounds.

Owns nothing shared: a `SequenceState` belongs to the one scheduler that holds it (the core
loop's thread), and moves whole between schedulers when a disaggregated core hands a
prompt's sequence from its prefill set to its decode set. `Emitted` is the event a
sampled token becomes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.core.speculation import MAX_SPECULATIVE_TOKENS
from engine.types import ConstraintMatcher, SamplingParams, TokenLogprobs


@dataclass(eq=False)  # one object per sample: the scheduler's `in` and `remove` compare
class SequenceState:  # identities, never every field of two sequences
    """One sample being generated, as the scheduler tracks it."""

    seq_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams  # seed set; its constraint, if any, is the grammar
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # the request's (stop_reason: the id)
    eos_token_ids: frozenset[int] = frozenset()  # the model's, unless the request ignores EOS
    prompt_logprobs: int | None = None  # alternatives per prompt position (None: none)
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose K/V the pages hold
    ahead: int = 0  # positions of it in the step in flight (scheduled ahead, not yet taken)
    owed: int = 0  # tokens that step samples for it (0 or 1)
    row: int | None = None  # device row while running
    preempted: int = 0  # times it was preempted
    cached_tokens: int = 0  # prompt positions its first admission took from the prefix cache
    arrived: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # its first step
    matcher: ConstraintMatcher | None = None  # structured outputs: where its grammar stands
    mask: np.ndarray | None = None  # the tokens its next sample may take (constrained only)
    prompt_entries: list[TokenLogprobs | None] = field(default_factory=list)
    accepted_average: float = MAX_SPECULATIVE_TOKENS  # speculation: drafts it has accepted
    recount: bool = False  # sampled on another device set: its row's counts are rebuilt
    adapter: int = 0  # its LoRA adapter's id (engine.lora.Adapters; 0: the base model)

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt) + self.output  # prompt then output, grown in place
        if self.sampling.seed is None:
            raise ValueError("sampling.seed must be set before the scheduler sees a sequence")
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def tokens(self) -> list[int]:
        """Prompt then output (read only: `append` grows it)."""
        return self._tokens

    def append(self, token: int) -> None:
        self.output.append(token)
        self._tokens.append(token)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to collect: only on its first pass over the prompt."""
        return self.prompt_logprobs is not None and not self.output and not self.owed

    @property
    def next_position(self) -> int:
        """Its first position no step has computed or is computing."""
        return self.computed + self.ahead

    @property
    def replays(self) -> bool:
        """Preempted, computing a token it had again: one query a step, the form (and so
        the bits) its K/V had when the token was sampled (XLA:CPU's decode-row attention
        differs in the last bits from a prompt chunk's)."""
        return len(self.prompt) <= self.next_position < self.length - 1

    @property
    def length(self) -> int:
        """Its tokens, counting the one the step in flight samples for it."""
        return len(self._tokens) + self.owed


@dataclass(frozen=True)
class Emitted:
    """A sampled token of a sequence; finish_reason set on its last one."""

    seq_id: str
    token: int
    logprob: float
    finish_reason: str | None = None  # "stop" | "length"
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob) best first, when it asked
    cached_tokens: int = 0  # prompt positions taken from the prefix cache (first token only)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # first token only
    done: bool = False  # its grammar is complete with this token
    error: str | None = None  # the sequence failed (its grammar refused); it has ended
    scheduled: float | None = None  # first token only: when its first step began
    stop_reason: int | None = None  # the stop token id that ended it (None: EOS or other)
