"""Speculative decoding's proposals: vLLM's `--speculative-config`, n-gram prompt lookup,
the `Proposer` seam (n-gram here, a draft model in engine.core.draft) and the
per-sequence backoff.

Runs on: the engine core's scheduler loop (engine.core.scheduler asks it; it holds no
state of its own but the counters). Owns: `SpeculativeConfig` (parsed and validated
once), `propose_ngram` (a pure function of a sequence's tokens), how many tokens a
sequence may propose (`Speculator.budget`, from its acceptance so far) and the
`SpecCounters` vLLM's metrics read. Receives `DraftRequest`s; emits draft tokens.

How drafts are verified (engine.core.scheduler, engine.core.runner): a speculating
sequence's next input and its k drafts run in one step as k + 1 decode rows over the
same page table (row j sees positions up to p + j), each sampled with the key of the
token it would be without speculation (generated + j). Its tokens are taken up to and
including the first sampled token that differs from its draft. A draft is accepted
exactly when the target's own sample equals it, so greedy and seeded output are the
tokens the sequence would get without speculation, and a sample is a draw from the
target distribution (Leviathan et al.'s rule for a draft that puts all its mass on one
token, as n-gram drafts do). Each row is an ordinary decode row, so on every backend a
position's logits have the bits they would have without speculation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.types import ConstraintMatcher

if TYPE_CHECKING:  # the runner imports jax: the HTTP process reads this module without it
    from engine.core.plan import StepPlan

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
PAUSE_BELOW = 0.25  # a sequence accepting fewer drafts on average pauses (Speculator)
RECOVERY = 0.03  # ...and its average recovers this much a paused step
_KEYS = {
    "ngram": frozenset(
        {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    ),
    "draft_model": frozenset({"method", "num_speculative_tokens", "model"}),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`, or `{"method": "draft_model",
    "model": PATH, "num_speculative_tokens": k}` (a local checkpoint with the target's
    vocabulary)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    model: str | None = None  # draft_model: the draft's checkpoint folder

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config takes model with method draft_model, and needs it")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the JSON text of --speculative-config; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("speculative_config must be a JSON object")
        if "method" not in data or "num_speculative_tokens" not in data:
            raise ValueError("speculative_config needs method and num_speculative_tokens")
        method = data["method"]
        known = _KEYS.get(method) if isinstance(method, str) else None
        if known is None:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"speculative_config does not support {', '.join(unknown)} with method {method}"
            )
        for key, value in data.items():
            if key == "model" and not (isinstance(value, str) and value):
                raise ValueError(f"speculative_config model must be a folder, got {value!r}")
            if key not in ("method", "model") and (
                not isinstance(value, int) or isinstance(value, bool)
            ):
                raise ValueError(f"speculative_config {key} must be an integer, got {value!r}")
        if method == "draft_model":
            if "model" not in data:
                raise ValueError("speculative_config needs model with method draft_model")
            return cls(method, data["num_speculative_tokens"], model=data["model"])
        high: int | None = data.get("prompt_lookup_max")
        low: int | None = data.get("prompt_lookup_min")
        if high is None:  # vLLM's: a bound not given is the other one, else both 5
            high = DEFAULT_LOOKUP if low is None else low
        if low is None:
            low = high
        return cls(method, data["num_speculative_tokens"], high, low)


def propose_ngram(tokens: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (the longest n in high..low that occurs), continued through the proposal itself
    where that occurrence runs into the end (a loop of period p < k proposes k tokens)."""
    length = len(tokens)
    if k < 1 or length < low + 1:
        return []
    ids = np.asarray(tokens, np.int64)
    for n in range(min(high, length - 1), low - 1, -1):
        # windows starting at 0..length-n-1: every occurrence but the tail itself
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            out = list(tokens)
            at = int(hits[-1]) + n
            for j in range(k):
                out.append(out[at + j])
            return out[length:]
    return []


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: drafts (sequence-steps that proposed), draft tokens,
    accepted tokens, and accepted tokens by position in the draft."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1


@dataclass(frozen=True)
class DraftRequest:
    """A decode row that may speculate: the sequence's tokens (the last is this step's
    input, at position `start`), its pages (enough for start + k + 1 positions), its
    device row, and at most how many tokens to propose."""

    tokens: Sequence[int]
    start: int
    pages: tuple[int, ...]
    row: int
    k: int


class Proposer(Protocol):
    """Where drafts come from: n-gram lookup on the host, or a draft model's steps."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Up to request.k tokens for each request (fewer, or none, where it has none)."""
        ...

    def follow(self, plan: StepPlan) -> None:
        """The target runs this plan: a draft model writes its own K/V for its tokens."""
        ...


class NgramProposer:
    """n-gram prompt lookup (`propose_ngram`): host only, nothing to follow."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        c = self.config
        return [
            propose_ngram(r.tokens, r.k, c.prompt_lookup_min, c.prompt_lookup_max) for r in requests
        ]

    def follow(self, plan: StepPlan) -> None:
        return None


@dataclass
class Speculator:
    """Proposes drafts for the scheduler's decode rows and keeps the counters.

    Backoff: a sequence proposes at most one more token than it has been accepting
    (`average_accepted`), and nothing while that average is below PAUSE_BELOW; each step
    it pauses the average recovers by RECOVERY, so it tries one token again about every
    five steps (a sequence whose drafts always fail costs a fifth of a row a step). At a
    full batch the scheduler has no rows to spare and nothing is proposed.
    """

    config: SpeculativeConfig
    proposer: Proposer
    counters: SpecCounters = field(default_factory=SpecCounters)

    def budget(self, accepted_average: float) -> int:
        if accepted_average < PAUSE_BELOW:
            return 0
        return min(self.config.num_speculative_tokens, int(accepted_average) + 1)


def grammar_masks(
    matcher: ConstraintMatcher, mask: np.ndarray, base: np.ndarray, draft: Sequence[int]
) -> tuple[np.ndarray, ...]:
    """A constrained sequence's draft checked against its grammar: the mask after each
    draft token (intersected with `base`, its allowed_token_ids), as far as the grammar
    allows them. A token it refuses ends the draft, and so does one that completes it
    (nothing is sampled after). The matcher is rolled back: the scheduler advances it
    through the accepted tokens only."""
    masks: list[np.ndarray] = []
    current, taken = mask, 0
    try:
        for token in draft:
            if not (int(current[token // 32]) >> (token % 32)) & 1:
                break
            done = matcher.advance(token)
            taken += 1
            if done:
                break
            current = np.empty_like(current)
            matcher.fill_mask(current)
            current &= base
            if not current.any():
                break
            masks.append(current)
    finally:
        matcher.rollback(taken)
    return tuple(masks)


def average_accepted(previous: float, proposed: int, accepted: int) -> float:
    """A sequence's running average (half-life one verification) of the drafts it accepts,
    counting a draft accepted whole as one more (it might have taken a longer one), so a
    sequence whose drafts are all right grows its draft by one each step."""
    return 0.5 * previous + 0.5 * (accepted + (accepted == proposed))
