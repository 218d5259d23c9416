"""The grammar worker: structured outputs' next-token masks, computed off the generate thread.

Runs on: one worker thread, fed by the generate stage. Owns: nothing between tasks;
the constrained samples' matchers belong to the generate stage's slot table, and are
touched only here, one task at a time, in the order the generate stage sent them.
Receives: a step's (or a prefill's) device tokens and the constrained slots among them.
Returns (a Future): per slot the mask of its next token, the slots whose output the
token completed, and the slots whose constraint rejected the token.

A task waits for the step's tokens here (np.asarray), so the generate thread hands
on the step, reads its inbox and inserts new samples while the device finishes and
the masks are computed; it waits only right before the next step, which needs them.
A step without constrained slots sends no task and waits for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.types import ConstraintMatcher


@dataclass(frozen=True)
class Constrained:
    """One constrained sample in a slot: its matcher and the allowed_token_ids it also obeys."""

    slot: int
    lease: int
    matcher: ConstraintMatcher
    base: np.ndarray | None  # int32 words of allowed_token_ids, None: every token


@dataclass(frozen=True)
class Advanced:
    """The worker's answer to one task."""

    masks: dict[int, tuple[int, np.ndarray]]  # slot -> (lease, mask of its next token)
    done: dict[int, int]  # slot -> lease, whose output is complete with this token
    failed: tuple[tuple[int, int, str], ...]  # (slot, lease, why) the constraint refused


class GrammarWorker:
    """A single worker thread (llguidance computes masks without the GIL)."""

    def __init__(self, words: int) -> None:
        self._words = words
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="orchestrator-grammar")
        self.tokens = 0  # counters: written by the worker thread only
        self.mask_seconds = 0.0  # time advancing matchers and computing masks, all tokens

    @property
    def words(self) -> int:
        """int32 words of one mask."""
        return self._words

    def submit(self, tokens: Any, entries: Sequence[Constrained]) -> Future[Advanced]:
        """Advance each entry by its token in `tokens` ((slots,) of a step, or the scalar
        of a prefill) and compute its next mask."""
        return self._pool.submit(self._advance, tokens, tuple(entries))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _advance(self, tokens: Any, entries: tuple[Constrained, ...]) -> Advanced:
        host = np.asarray(tokens)  # the wait for the device is here, not on the generate thread
        started = time.perf_counter()
        masks: dict[int, tuple[int, np.ndarray]] = {}
        done: dict[int, int] = {}
        failed: list[tuple[int, int, str]] = []
        for entry in entries:
            token = int(host) if host.ndim == 0 else int(host[entry.slot])
            try:
                if entry.matcher.advance(token):
                    done[entry.slot] = entry.lease
                    continue
                mask = np.empty((self._words,), np.int32)
                entry.matcher.fill_mask(mask)
                if entry.base is not None:
                    mask &= entry.base
                if not mask.any():
                    raise ValueError("no token the request allows can come next")
            except ValueError as exc:  # the request's constraint, not the stage, failed
                failed.append((entry.slot, entry.lease, str(exc)))
                continue
            masks[entry.slot] = (entry.lease, mask)
        self.tokens += len(entries)
        self.mask_seconds += time.perf_counter() - started
        return Advanced(masks, done, tuple(failed))
