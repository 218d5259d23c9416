"""What crosses the seam between the scheduler and the runner, one step at a time.

Owns nothing mutable: frozen values. The scheduler emits a `StepPlan` (each sequence's
`RowWork`: its tokens, positions, pages, device row and sampling); the runner returns a
`StepResult` (host numpy: each sequence's sampled token with its logprobs, and the
prompt logprobs the plan asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.paged_model import Chunk
from engine.types import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class RowWork:
    """One sequence's share of a step, as the scheduler planned it."""

    chunk: Chunk  # its tokens this step, their first position, its page table
    row: int  # its device row (penalty counts), 0..max_num_seqs - 1
    sampling: SamplingParams
    generated: int  # tokens it has sampled so far: which key its next token takes
    emits: bool = True  # the step samples its next token (not a prompt chunk short of the end)
    fresh: bool = False  # its first step: the row's counts start from zero...
    prior: tuple[int, ...] = ()  # its row's counts rebuilt from these tokens first: those it
    # sampled before a preemption, or on a disaggregated core's other device set
    seen: tuple[int, ...] = ()  # ...and its prompt, marked there for its repetition penalty
    allowed: np.ndarray | None = None  # structured outputs: its next token's mask
    prompt_next: tuple[int, ...] = ()  # prompt logprobs: each position's next prompt token
    prompt_top: int = 0  # ...and how many alternatives each
    drafts: tuple[int, ...] = ()  # speculation: tokens to verify after its one decode token
    draft_allowed: tuple[np.ndarray, ...] = ()  # ...with a grammar: each draft row's mask
    carry: int = -1  # scheduled ahead: its one token is row `carry` of the step before's
    lora: int = -1  # its LoRA adapter's slot in the pool (engine.lora.NO_ADAPTER: none)

    @property
    def sample_rows(self) -> int:
        """Rows of the step it is sampled in: its decode row and one per draft token."""
        return 1 + len(self.drafts)


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[RowWork, ...]
    # LoRA adapters to write into pool slots before the step: (slot, adapter id)
    lora_writes: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        return sum(len(r.chunk.tokens) + len(r.drafts) for r in self.rows)

    @property
    def sample_rows(self) -> int:
        return sum(r.sample_rows for r in self.rows)

    def offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each row's first token in the step, and its first sampled row."""
        starts, rows, at, row = [], [], 0, 0
        for r in self.rows:
            starts.append(at)
            rows.append(row)
            at += len(r.chunk.tokens) + len(r.drafts)
            row += r.sample_rows
        return tuple(starts), tuple(rows)

    def lora_slots(self, tokens: int) -> np.ndarray:
        """Each of `tokens` (the padded step's) adapter slot: its row's, drafts included;
        padding none."""
        out = np.full(tokens, -1, np.int32)
        for start, r in zip(self.offsets()[0], self.rows, strict=True):
            out[start : start + len(r.chunk.tokens) + len(r.drafts)] = r.lora
        return out

    def chunks(self) -> list[Chunk]:
        """The step's sequences as attention sees them: a speculating row's decode token and
        each of its drafts are sequences of one query over its pages, so every one of them
        is an ordinary decode row (the bits it would have without speculation)."""
        out = []
        for r in self.rows:
            c = r.chunk
            out.append(c)
            out += [Chunk((d,), c.start + 1 + j, c.pages) for j, d in enumerate(r.drafts)]
        return out


@dataclass(frozen=True)
class PromptLogprobs:
    """Per token of a step: the logprob of the prompt token after it, and the best ones."""

    chosen: np.ndarray  # (T,) float32
    top_ids: np.ndarray  # (T, MAX_LOGPROBS) int32
    top_logprobs: np.ndarray  # (T, MAX_LOGPROBS) float32


@dataclass(frozen=True)
class StepResult:
    tokens: np.ndarray  # (rows,) int32: each sequence's sampled token
    logprobs: np.ndarray  # (rows,) float32: its logprob (zeros unless some row asked)
    top_ids: np.ndarray  # (rows, MAX_LOGPROBS) int32
    top_logprobs: np.ndarray  # (rows, MAX_LOGPROBS) float32
    starts: tuple[int, ...] = ()  # each row's first token in the step
    sample_rows: tuple[int, ...] = ()  # each row's first sampled row (past a row's drafts)
    prompt: PromptLogprobs | None = None  # when some row asked for prompt logprobs
    # (rows, MAX_LOGPROB_TOKEN_IDS) float32: the logprobs of each row's logprob_token_ids
    picked_logprobs: np.ndarray | None = None

    def alternatives(self, at: int, sampling: SamplingParams) -> tuple[tuple[int, float], ...]:
        """Sample row `at`'s alternatives as (id, logprob): the best first, or with
        logprob_token_ids (vLLM's) those ids in the order asked; none without logprobs."""
        picked = sampling.logprob_token_ids
        if picked and self.picked_logprobs is not None:
            values = self.picked_logprobs[at, : len(picked)]
            return tuple((t, float(p)) for t, p in zip(picked, values, strict=True))
        if sampling.logprobs is None:
            return ()
        pairs = zip(self.top_ids[at], self.top_logprobs[at], strict=True)
        return tuple((int(t), float(p)) for t, p in pairs)

    def prompt_entries(self, row: int, work: RowWork) -> list[TokenLogprobs | None]:
        """Row `row`'s prompt logprobs: one entry per position whose next token is the
        prompt's (vLLM's: the logprob of prompt token p + 1 given those before it)."""
        assert self.prompt is not None
        start, k = self.starts[row], work.prompt_top
        out: list[TokenLogprobs | None] = []
        for i, following in enumerate(work.prompt_next):
            if following < 0:
                break
            t = start + i
            top = tuple(
                (int(a), float(b))
                for a, b in zip(
                    self.prompt.top_ids[t, :k], self.prompt.top_logprobs[t, :k], strict=True
                )
            )
            out.append(TokenLogprobs(following, float(self.prompt.chosen[t]), top))
        return out
