"""A sequence as the scheduler tracks it, the tokens it emits, and the scheduler's bounds.

Owns nothing shared: a `Sequence` belongs to the one scheduler that holds it (the core
loop's thread), and moves whole between schedulers when a disaggregated core hands a
prompt's sequence from its prefill set to its decode set. `Emitted` is the event a
sampled token becomes; `SchedulerConfig` the bounds a scheduler plans within;
`advance_grammar` a sequence's structured-output matcher taking its sampled token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.core.speculation import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from engine.types import ConstraintMatcher, SamplingParams, TokenLogprobs


@dataclass(eq=False)  # one object per sample: the scheduler's `in` and `remove` compare
class Sequence:  # identities, never every field of two sequences
    """One sample being generated, as the scheduler tracks it."""

    seq_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams  # seed set; its constraint, if any, is the grammar
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignored) and the request's
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


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunk_size: int  # prompt positions per chunk, a multiple of the page size
    max_prefill_seqs: int = 0  # prompt chunks per step (0: as many as the budget takes)
    vocab_size: int = 0  # for allowed_token_ids' masks (0: no masks)
    speculative: SpeculativeConfig | None = None  # drafts for decode rows (None: none)
    max_loras: int = 0  # LoRA adapters resident at once (engine.core.lora_slots)
    # a disaggregated core's prefill set: prompts only; a sequence leaves for the decode
    # set once its first token is sampled (Scheduler.take_handoffs)
    prefill_only: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_size {self.chunk_size} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        if self.max_prefill_seqs < 0:
            raise ValueError(f"max_prefill_seqs must be >= 0, got {self.max_prefill_seqs}")
        if self.prefill_only and self.speculative is not None:
            raise ValueError("a prefill-only scheduler does not speculate")
        if self.max_prefill_seqs == 0:
            self.max_prefill_seqs = self.max_num_batched_tokens


def advance_grammar(seq: Sequence, token: int, base: np.ndarray) -> tuple[bool, str | None]:
    """(grammar complete, why it failed): seq's matcher takes the token, and the mask of
    its next one is computed within `base` (allowed_token_ids'; an empty mask fails it)."""
    if seq.matcher is None:
        return False, None
    try:
        if seq.matcher.advance(token):
            return True, None
        mask = np.empty_like(base)
        seq.matcher.fill_mask(mask)
        mask &= base
        if not mask.any():
            raise ValueError("no token the request allows can come next")
    except ValueError as exc:  # the request's constraint failed, not the core
        return False, str(exc)
    seq.mask = mask
    return False, None
