"""The scheduler: every decision of the engine core, one step at a time.

Runs on: the engine core's loop thread (single-threaded: it is the only code that reads or
writes the state below). Owns: the waiting queue, the running sequences, their pages
(through engine.core.pages.PagePool, whose prefix cache it feeds, keyed by LoRA adapter),
their device rows and their adapters' pool slots (engine.core.lora_slots), token budgets,
stop by length or stop token, structured outputs' matchers and masks, and preemption.
Receives: `add` and `abort`, and each step's `StepResult`. Emits: a `StepPlan` per step
(engine.core.runner) and `Emitted` events, one per sampled token, in order.

Each step: every running sequence with a token to feed is a decode row (one query); then
prompt chunks, running ones first, then new sequences in arrival order (passing over one
whose adapter waits for a pool slot), as far as `max_num_batched_tokens` and
`max_prefill_seqs` go. A prompt is computed in chunks of `chunk_size` positions aligned from
position 0 (a prefix-cache hit skips whole pages; the chunk after it ends on the same
boundary a fresh prompt's would), so decode rows are never stalled for more than one chunk's
worth of tokens; in a step with decode rows, chunks of `decode_chunk_size` where the
attention backend gives a query the same bits in any chunk (`any_form_hits`), so a running
stream waits a small step, not a whole chunk's, for each prompt that arrives. Out of
pages, the sequence admitted last is preempted: its pages and row
are released and it waits at the front of the queue, to be computed again from its prompt
and the tokens it has (vLLM's recompute policy; the prompt in its chunks, each token it had
as a decode row again, so no bit changes): a client never sees it.

With one step in flight (`schedule(ahead=True)`), the next step is planned from what the one
in flight will leave: each sequence's `ahead` positions and `owed` token count until
`update` takes that step, and a row that feeds an owed token names its row of the step in
flight (`RowWork.carry`), read on the device. Steps are updated in the order planned; a row
of a sequence that ended in between (a stop token, an abort) is dropped.

Disaggregated (engine.core.disaggregated): a `prefill_only` scheduler plans prompt chunks
only and lets each sequence go, pages and all, once its first token is sampled
(`take_handoffs`); the decode set's scheduler `adopt`s it as a running sequence whose next
step is its first decode row, its row's penalty counts rebuilt from its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import numpy as np

from engine.core.config import SchedulerConfig
from engine.core.lora_slots import LoraSlots
from engine.core.pages import PagePool, root_key
from engine.core.plan import RowWork, StepPlan, StepResult
from engine.core.rules import advance_grammar, budget_spent, finish_reason
from engine.core.sequence import Emitted, SequenceState
from engine.core.speculation import (
    PAUSE_BELOW,
    RECOVERY,
    DraftRequest,
    NgramProposer,
    Proposer,
    Speculator,
    average_accepted,
    grammar_masks,
)
from engine.paged_model import Chunk
from engine.token_mask import token_bitmask


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, pool: PagePool, proposer: Proposer | None = None
    ) -> None:
        """`proposer`: where speculative drafts come from (default: n-gram lookup)."""
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
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.lora = LoraSlots(config.max_loras)  # adapters' pool slots
        # the steps dispatched and not yet updated, oldest first (at most 2: the one the
        # loop waits for, and the one it scheduled ahead)
        self._inflight: deque[tuple[StepPlan, list[SequenceState]]] = deque()
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's)
        self.prefix_hits = 0  # of those, found
        self.preemptions = 0
        self._handoffs: list[SequenceState] = []  # prefill_only: first token sampled, pages held
        spec = config.speculative
        self.speculator = None
        if spec is not None:
            if proposer is None and spec.method != "ngram":
                raise ValueError(f"speculative method {spec.method} needs its proposer")
            self.speculator = Speculator(spec, proposer or NgramProposer(spec))

    # -- requests -----------------------------------------------------------------------
    def add(self, seq: SequenceState) -> None:
        limit = self.config.max_model_len
        if len(seq.prompt) >= limit:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens leaves no room in {limit}")
        constraint = seq.sampling.constraint
        if constraint is not None:
            seq.matcher = constraint.matcher()
            seq.mask = np.asarray(constraint.initial_mask(), np.int32) & self._base(seq)
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is; False if it is not here (already finished)."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq)
                    return True
        return False

    @property
    def can_adopt(self) -> bool:
        """`adopt` would take a sequence now (given its pages)."""
        return bool(self._free_rows) and not self.waiting

    def adopt(self, seq: SequenceState, pages: list[int]) -> bool:
        """Run a sequence whose prompt was computed and first token sampled on another
        scheduler (a disaggregated core's prefill set), with its grammar's state and tokens,
        its K/V already copied into `pages` of this pool (held for it): its next step is a
        decode row, as it would have been there. False (nothing changes) when no row is
        free, or sequences wait here (they go first)."""
        if not self.can_adopt:
            return False
        seq.row = self._free_rows.pop()
        seq.pages, seq.computed, seq.ahead, seq.owed = pages, len(seq.tokens) - 1, 0, 0
        seq.recount = True
        self.running.append(seq)
        return True

    def take_handoffs(self) -> list[SequenceState]:
        """prefill_only: the sequences whose first token was sampled since the last call,
        out of this scheduler, each still holding its pages (the caller frees them)."""
        out, self._handoffs = self._handoffs, []
        return out

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def in_flight(self) -> int:
        """Steps planned and not yet updated."""
        return len(self._inflight)

    # -- one step -----------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """The next step's plan (None: nothing to run).

        `ahead`: the step in flight has not been updated yet; plan the next one from what it
        will leave (its sequences' next positions, a sampled token in place of each one it
        owes, that token read on the device: `RowWork.carry`). None whenever that plan would
        need what the step in flight decides: preemption, a grammar's mask after its token,
        speculation, or a sequence whose token there may be its last.

        Running sequences keep their place by preempting the latest admitted ones not yet
        planned this step; a running prompt that still cannot get pages holds back new
        admissions (they would take the pages it waits for). So whenever a sequence runs or
        waits, the step has work: the oldest running sequence can always preempt every later
        one, and one max_model_len sequence fits the pool (checked at start)."""
        carries: dict[int, int] = {}
        if ahead:
            if self.speculator is not None or len(self._inflight) != 1:
                return None
            plan, seqs = self._inflight[0]
            carries = {id(q): at for q, at in zip(seqs, plan.offsets()[1], strict=True)}
        budget = self.config.max_num_batched_tokens
        chunks = self.config.max_prefill_seqs
        work: list[RowWork] = []
        planned: list[SequenceState] = []
        preempt: list[SequenceState] | None = None if ahead else planned
        blocked = False
        for seq in list(self.running):  # decode rows first, in admission order
            if self.config.prefill_only:
                break  # its sequences leave once their prompt is computed
            if seq not in self.running:
                continue
            if seq.next_position != seq.length - 1 and not seq.replays:
                continue
            if seq.owed and seq.matcher is not None:
                return None  # its mask follows the token in flight
            if seq.owed and self._last_owed(seq):
                continue  # the token in flight is its last
            if not self._reserve(seq, seq.next_position + 1, preempt):
                if ahead:
                    return None
                continue  # preempted itself
            work.append(self._work(seq, 1, carry=carries[id(seq)] if seq.owed else -1))
            planned.append(seq)
            budget -= 1
        # beside decode rows a smaller chunk, so a running stream waits less for a prompt
        size = self.config.chunk_size
        if work and self.config.decode_chunk_size:
            size = self.config.decode_chunk_size
        for seq in [s for s in self.running if s.next_position < min(len(s.prompt), s.length - 1)]:
            if seq not in self.running:
                continue  # preempted by an older prompt of this step
            n = self._chunk(seq, size)
            if chunks == 0 or n > budget:
                break
            if not self._reserve(seq, seq.next_position + n, preempt):
                if ahead:
                    return None
                blocked = True
                break
            work.append(self._work(seq, n))
            planned.append(seq)
            budget -= n
            chunks -= 1
        while not blocked and self._free_rows and budget > 0 and chunks > 0:
            if (waiting := self.lora.first(self.waiting)) is None:
                break  # none, or each one's adapter waits for a pool slot
            seq = waiting
            self._match(seq)
            n = self._chunk(seq, size)
            if n > budget or not self._reserve(seq, seq.computed + n, None):
                self._unmatch(seq)
                break
            self.waiting.remove(seq)
            seq.row = self._free_rows.pop()
            if seq.scheduled is None:
                seq.scheduled = time.monotonic()
            self.running.append(seq)
            work.append(self._work(seq, n, fresh=True))
            planned.append(seq)
            budget -= n
            chunks -= 1
        if self.speculator is not None:
            work = self._speculate(work, planned, budget)
        if not work:
            if self.busy and not ahead:
                raise RuntimeError("the scheduler planned nothing while sequences wait")
            return None
        plan = StepPlan(tuple(work), self.lora.take_writes())
        for seq, row in zip(planned, work, strict=True):
            seq.ahead += len(row.chunk.tokens)
            seq.owed += int(row.emits)
            seq.recount = False
        self._inflight.append((plan, planned))
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Take a step's sampled tokens: advance each sequence, finish those that end."""
        events: list[Emitted] = []
        oldest, seqs = self._inflight.popleft()
        assert oldest is plan, "steps are updated in the order they were scheduled"
        for i, (seq, work) in enumerate(zip(seqs, plan.rows, strict=True)):
            if seq.row is None:
                continue  # released (a stop token, an abort) after this step was planned
            seq.ahead -= len(work.chunk.tokens)
            seq.owed -= int(work.emits)
            if work.drafts:
                events += self._verify(seq, work, result, result.sample_rows[i])
                continue
            seq.computed += len(work.chunk.tokens)
            self.pool.register(seq.pages, seq.tokens, seq.computed, root_key(seq.adapter))
            if work.prompt_next:
                seq.prompt_entries += result.prompt_entries(i, work)
            if work.emits:
                event = self._take(seq, result, result.sample_rows[i])
                events.append(event)
                if event.finish_reason is not None:
                    self._finish(seq)
                elif self.config.prefill_only:
                    self._hand_off(seq)
        return events

    def _take(self, seq: SequenceState, result: StepResult, at: int) -> Emitted:
        """Sample row `at` of the result is seq's next token: append it and say so."""
        token = int(result.tokens[at])
        first = not seq.output
        seq.append(token)
        done, error = advance_grammar(seq, token, self._base(seq))
        reason: str | None = "stop"  # a complete or failed grammar ends it
        stop_reason: int | None = None
        if not done and error is None:
            reason, stop_reason = finish_reason(seq, token, self.config.max_model_len)
        top = result.alternatives(at, seq.sampling)
        prompt = None
        if first and seq.prompt_logprobs is not None:
            prompt = (None, *seq.prompt_entries)
        return Emitted(
            seq.seq_id,
            token,
            float(result.logprobs[at]),
            reason,
            top,
            cached_tokens=seq.cached_tokens if first else 0,
            prompt_logprobs=prompt,
            done=done,
            error=error,
            scheduled=seq.scheduled if first else None,
            stop_reason=stop_reason,
        )

    def _verify(
        self, seq: SequenceState, work: RowWork, result: StepResult, at: int
    ) -> list[Emitted]:
        """A speculating row: its tokens are the sampled ones up to and including the
        first that differs from its draft; the K/V of the inputs before that one stay,
        the pages past its tokens go back (engine.core.speculation)."""
        drafts = work.drafts
        sampled = result.tokens[at : at + len(drafts) + 1]
        accepted = 0
        while accepted < len(drafts) and int(sampled[accepted]) == drafts[accepted]:
            accepted += 1
        assert self.speculator is not None
        self.speculator.counters.record(len(drafts), accepted)
        seq.accepted_average = average_accepted(seq.accepted_average, len(drafts), accepted)
        events = []
        for j in range(accepted + 1):
            event = self._take(seq, result, at + j)
            events.append(event)
            if event.finish_reason is not None:
                self._finish(seq)
                return events
        seq.computed += accepted + 1
        self.pool.register(seq.pages, seq.tokens, seq.computed, root_key(seq.adapter))
        self._trim(seq, len(seq.tokens))
        return events

    def _hand_off(self, seq: SequenceState) -> None:
        """Out of running, its row free, its pages still its own (take_handoffs)."""
        self.running.remove(seq)
        self._release(seq, pages=False)
        self._handoffs.append(seq)

    def _finish(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self._release(seq)

    def _speculate(
        self, work: list[RowWork], planned: list[SequenceState], budget: int
    ) -> list[RowWork]:
        """Drafts for decode rows, in admission order, within the rows and tokens the step
        has left (a full batch has none) and the pages free without preempting anyone;
        pages a shorter draft does not use go back."""
        assert self.speculator is not None
        room = min(self.config.max_num_seqs - len(work), budget)
        asked: list[tuple[int, DraftRequest]] = []
        for i, (seq, row) in enumerate(zip(planned, work, strict=True)):
            if room <= 0:
                break
            if len(row.chunk.tokens) != 1 or not row.emits or not seq.output:
                continue
            if seq.sampling.penalized:
                continue  # a position's penalties count the tokens before it
            k = min(
                room,
                self.speculator.budget(seq.accepted_average),
                seq.max_tokens - len(seq.output) - 1,
                self.config.max_model_len - len(seq.tokens) - 1,
            )
            if k <= 0 and seq.accepted_average < PAUSE_BELOW:
                seq.accepted_average += RECOVERY  # paused: it tries again in a few steps
            if k <= 0 or not self._reserve(seq, seq.computed + 1 + k, None):
                continue
            asked.append(
                (i, DraftRequest(seq.tokens, seq.computed, tuple(seq.pages), seq.row or 0, k))
            )
            room -= k
        out = list(work)
        drafts = self.speculator.proposer.propose([r for _, r in asked]) if asked else []
        for (i, _), draft in zip(asked, drafts, strict=True):
            seq = planned[i]
            masks: tuple[np.ndarray, ...] = ()
            if seq.matcher is not None and seq.mask is not None:
                masks = grammar_masks(seq.matcher, seq.mask, self._base(seq), draft)
                draft = draft[: len(masks)]
            self._trim(seq, seq.computed + 1 + len(draft))
            if draft:
                chunk = replace(work[i].chunk, pages=tuple(seq.pages))
                out[i] = replace(work[i], chunk=chunk, drafts=tuple(draft), draft_allowed=masks)
        return out

    def _trim(self, seq: SequenceState, positions: int) -> None:
        """Give back seq's pages past those `positions` need (never a registered one: those
        hold positions it has computed)."""
        keep = -(-positions // self.pool.page_size)
        if len(seq.pages) > keep:
            self.pool.free(seq.pages[keep:])
            del seq.pages[keep:]

    # -- helpers ------------------------------------------------------------------------
    def _last_owed(self, seq: SequenceState) -> bool:
        """The token the step in flight samples for seq ends it by length."""
        outputs = len(seq.output) + seq.owed
        return budget_spent(seq, outputs, seq.length, self.config.max_model_len)

    def _base(self, seq: SequenceState) -> np.ndarray:
        """allowed_token_ids' mask (every token when it has none)."""
        return token_bitmask(seq.sampling.allowed_token_ids, self.config.vocab_size)

    def _chunk(self, seq: SequenceState, size: int) -> int:
        """Positions of its prompt the next chunk covers: up to the next multiple of
        `size` (chunk_size, or decode_chunk_size beside decode rows), not past the prompt;
        past the prompt (a preempted sequence computing its tokens again) one position,
        fed alone as when the token was sampled."""
        start = seq.next_position
        if start >= len(seq.prompt):
            return 1
        return min((start // size + 1) * size, len(seq.prompt)) - start

    def _work(self, seq: SequenceState, n: int, fresh: bool = False, carry: int = -1) -> RowWork:
        """`carry`: seq owes a token (its row of the step in flight): the one to feed."""
        start = seq.next_position
        assert seq.row is not None
        tokens = seq.tokens
        assert (carry >= 0) == bool(seq.owed), "a row feeds the token it owes, none other"
        prompt_next: tuple[int, ...] = ()
        if seq.wants_prompt_logprobs:  # each position's next prompt token (-1: none)
            prompt_next = tuple(
                tokens[p + 1] if p + 1 < len(seq.prompt) else -1 for p in range(start, start + n)
            )
        fed = (0,) if seq.owed else tokens[start : start + n]  # 0: read on the device
        rebuilt = fresh or seq.recount  # the row's counts are (re)built this step
        seen = tuple(seq.prompt) if rebuilt and seq.sampling.repetition_penalty != 1.0 else ()
        return RowWork(
            chunk=Chunk(fed, start, tuple(seq.pages)),
            row=seq.row,
            sampling=seq.sampling,
            generated=len(seq.output) + seq.owed,
            emits=start + n == seq.length,
            fresh=fresh and not seq.output and not seen,
            prior=tuple(seq.output) if rebuilt else (),
            seen=seen,
            allowed=seq.mask,
            prompt_next=prompt_next,
            prompt_top=seq.prompt_logprobs or 0,
            carry=carry,  # admitted (fresh): its adapter takes a pool slot now
            lora=self.lora.acquire(seq.adapter) if fresh else self.lora.slot(seq.adapter),
        )

    def _reserve(
        self, seq: SequenceState, positions: int, planned: list[SequenceState] | None
    ) -> bool:
        """Pages for `positions` positions of seq. Given `planned`, it preempts the latest
        admitted sequences not in it (seq itself last) until they fit; None: no preemption.
        False: seq did not get them (and is preempted, if it was the one left)."""
        needed = -(-positions // self.pool.page_size) - len(seq.pages)
        while needed > 0:
            pages = self.pool.allocate(needed)
            if pages is not None:
                seq.pages += pages
                return True
            if planned is None:
                return False
            victim = next((s for s in reversed(self.running) if s not in planned), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)  # never one planned this step (see _reserve)
        self._release(seq)
        seq.computed = 0
        seq.preempted += 1
        self.preemptions += 1
        if seq.wants_prompt_logprobs:
            seq.prompt_entries = []  # collected again from position 0
        self.waiting.appendleft(seq)

    def _match(self, seq: SequenceState) -> None:
        if seq.computed == 0 and not seq.pages:
            if seq.wants_prompt_logprobs:
                return  # every prompt position's logits are needed: no hit may skip one
            seq.pages = self.pool.match_prefix(seq.tokens, root_key(seq.adapter))
            last = len(seq.prompt) - 1
            short = len(seq.pages) * self.pool.page_size == last and last % self.config.chunk_size
            if short and not self.config.any_form_hits:
                # One prompt position left would run as a decode row, computed without the
                # hit in a chunk; where the backend's two forms differ in the last bits
                # (XLA:CPU's tiles, the TPU and GPU kernels), it takes its last page's
                # positions with it.
                self.pool.free(seq.pages[-1:])
                del seq.pages[-1:]
            seq.computed = len(seq.pages) * self.pool.page_size
            if not seq.preempted:
                seq.cached_tokens = seq.computed
                if self.pool.prefix_caching:
                    self.prefix_queries += len(seq.prompt)
                    self.prefix_hits += seq.computed

    def _unmatch(self, seq: SequenceState) -> None:
        """Undo `_match`: it stays waiting (its lookup counts again when it is admitted)."""
        self._release(seq)
        seq.computed = 0
        if seq.preempted or seq.wants_prompt_logprobs:
            return
        if self.pool.prefix_caching:
            self.prefix_queries -= len(seq.prompt)
            self.prefix_hits -= seq.cached_tokens
        seq.cached_tokens = 0

    def _release(self, seq: SequenceState, pages: bool = True) -> None:
        if pages and seq.pages:  # a sequence handed off keeps them
            self.pool.free(seq.pages)
            seq.pages = []
        if seq.row is not None:
            self._free_rows.append(seq.row)
            self.lora.release(seq.adapter)
            seq.row = None
