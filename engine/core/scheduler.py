"""The scheduler: every decision of the engine core, one step at a time.

Runs on: the engine core's loop thread (single-threaded: it is the only code that
reads or writes the state below). Owns: the waiting queue, the running sequences,
their pages (through engine.core.pages.PagePool, whose prefix cache it feeds), their
device rows, token budgets and stop by length or stop token, and preemption.
Receives: `add` and `abort`, and each step's `StepResult`. Emits: a `StepPlan` per
step (engine.core.runner) and `Emitted` events, one per sampled token, in order.

Each step: every running sequence with a token to feed is a decode row (one query);
then prompt chunks, running ones first, then new sequences in arrival order, as far
as `max_num_batched_tokens` goes. A prompt is computed in chunks of `chunk_size`
positions aligned from position 0 (a prefix-cache hit skips whole pages; the
chunk after it ends on the same boundary a fresh prompt's would), so decode rows are
never stalled for more than one chunk's worth of tokens. Out of pages, the sequence
admitted last is preempted: its pages and row are released and it waits at the front
of the queue, to be computed again from its prompt and the tokens it has (vLLM's
recompute policy): a client never sees it, and its seeded tokens do not change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.core.pages import PagePool
from engine.core.runner import Chunk, RowWork, StepPlan, StepResult
from engine.types import SamplingParams


@dataclass
class Sequence:
    """One sample being generated, as the scheduler tracks it."""

    seq_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams  # seed set
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignored) and the request's
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose K/V the pages hold
    row: int | None = None  # device row while running
    preempted: int = 0  # times it was preempted
    cached_tokens: int = 0  # prompt positions its first admission took from the prefix cache

    def __post_init__(self) -> None:
        if self.sampling.seed is None:
            raise ValueError("sampling.seed must be set before the scheduler sees a sequence")
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)


@dataclass(frozen=True)
class Emitted:
    """A sampled token of a sequence; finish_reason set on its last one."""

    seq_id: str
    token: int
    logprob: float
    finish_reason: str | None = None  # "stop" | "length"
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob) best first, when it asked


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunk_size: int  # prompt positions per chunk, a multiple of the page size

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_size {self.chunk_size} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        if config.chunk_size % pool.page_size:
            raise ValueError(
                f"chunk_size {config.chunk_size} must be a multiple of the page size "
                f"{pool.page_size}"
            )
        per_seq = -(-config.max_model_len // pool.page_size)
        if per_seq > pool.num_pages:
            raise ValueError(
                f"{pool.num_pages} pages of {pool.page_size} positions cannot hold one "
                f"sequence of max_model_len {config.max_model_len} ({per_seq} pages)"
            )
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._plan: list[Sequence] = []

    # -- requests -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        limit = self.config.max_model_len
        if len(seq.prompt) >= limit:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens leaves no room in {limit}")
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is; False if it is not here (already finished)."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._release(seq)
                return True
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.running.remove(seq)
                self._release(seq)
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan (None: nothing to run)."""
        budget = self.config.max_num_batched_tokens
        work: list[RowWork] = []
        planned: list[Sequence] = []
        for seq in list(self.running):  # decode rows first
            if seq not in self.running or seq.computed != len(seq.tokens) - 1:
                continue
            if not self._reserve(seq, seq.computed + 1, preempt=True):
                continue  # preempted itself
            work.append(self._work(seq, 1))
            planned.append(seq)
            budget -= 1
        for seq in [s for s in self.running if s.computed < len(s.tokens) - 1]:
            n = self._chunk(seq)
            if n > budget or not self._reserve(seq, seq.computed + n, preempt=False):
                break
            work.append(self._work(seq, n))
            planned.append(seq)
            budget -= n
        while self.waiting and self._free_rows and budget > 0:
            seq = self.waiting[0]
            self._match(seq)
            n = self._chunk(seq)
            if n > budget or not self._reserve(seq, seq.computed + n, preempt=False):
                self._unmatch(seq)
                break
            self.waiting.popleft()
            seq.row = self._free_rows.pop()
            self.running.append(seq)
            work.append(self._work(seq, n, fresh=True))
            planned.append(seq)
            budget -= n
        self._plan = planned
        return StepPlan(tuple(work)) if work else None

    def update(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Take a step's sampled tokens: advance each sequence, finish those that end."""
        events = []
        for i, (seq, work) in enumerate(zip(self._plan, plan.rows, strict=True)):
            seq.computed += len(work.chunk.tokens)
            self.pool.register(seq.pages, seq.tokens[: seq.computed])
            if not work.emits:
                continue
            token = int(result.tokens[i])
            seq.output.append(token)
            reason = self._finish_reason(seq, token)
            top: tuple[tuple[int, float], ...] = ()
            if seq.sampling.logprobs is not None:
                pairs = zip(result.top_ids[i], result.top_logprobs[i], strict=True)
                top = tuple((int(t), float(p)) for t, p in pairs)
            events.append(Emitted(seq.seq_id, token, float(result.logprobs[i]), reason, top))
            if reason is not None:
                self.running.remove(seq)
                self._release(seq)
        self._plan = []
        return events

    # -- helpers ------------------------------------------------------------------------
    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_token_ids and len(seq.output) > seq.sampling.min_tokens:
            return "stop"
        if len(seq.output) >= seq.max_tokens or len(seq.tokens) >= self.config.max_model_len:
            return "length"
        return None

    def _chunk(self, seq: Sequence) -> int:
        """Positions of its prompt (or recomputed tokens) the next chunk covers: up to the
        next multiple of chunk_size, not past the last token it has."""
        size = self.config.chunk_size
        boundary = (seq.computed // size + 1) * size
        return min(boundary, len(seq.tokens)) - seq.computed

    def _work(self, seq: Sequence, n: int, fresh: bool = False) -> RowWork:
        start = seq.computed
        assert seq.row is not None
        return RowWork(
            chunk=Chunk(seq.tokens[start : start + n], start, tuple(seq.pages)),
            row=seq.row,
            sampling=seq.sampling,
            generated=len(seq.output),
            emits=start + n == len(seq.tokens),
            fresh=fresh and not seq.output,
            prior=tuple(seq.output) if fresh else (),
        )

    def _reserve(self, seq: Sequence, positions: int, preempt: bool) -> bool:
        """Pages for `positions` positions of seq; with `preempt`, preempting the latest
        admitted others (then seq itself) until they fit. False: seq did not get them."""
        needed = -(-positions // self.pool.page_size) - len(seq.pages)
        while needed > 0:
            pages = self.pool.allocate(needed)
            if pages is not None:
                seq.pages += pages
                return True
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)  # the latest admitted: never one planned earlier this step
        self._release(seq)
        seq.computed = 0
        seq.preempted += 1
        self.waiting.appendleft(seq)

    def _match(self, seq: Sequence) -> None:
        if seq.computed == 0 and not seq.pages:
            seq.pages = self.pool.match_prefix(seq.tokens)
            seq.computed = len(seq.pages) * self.pool.page_size
            if not seq.preempted:
                seq.cached_tokens = seq.computed

    def _unmatch(self, seq: Sequence) -> None:
        self._release(seq)
        seq.computed = 0

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.pool.free(seq.pages)
        seq.pages = []
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row = None
