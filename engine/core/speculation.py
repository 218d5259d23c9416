"""Speculative decoding's proposals: vLLM's `--speculative-config`, n-gram prompt lookup,
and the per-sequence backoff.

Runs on: the engine core's scheduler loop (engine.core.scheduler asks it; it holds no
state of its own but the counters). Owns: `SpeculativeConfig` (parsed and validated
once), `propose_ngram` (a pure function of a sequence's tokens), how many tokens a
sequence may propose (`Speculator.budget`, from its acceptance so far) and the
`SpecCounters` vLLM's metrics read. Receives a sequence's tokens; emits draft tokens.

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

import numpy as np

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            hint = " (a draft model is not supported yet)" if self.method == "draft_model" else ""
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}{hint}"
            )
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
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config does not support {', '.join(unknown)}")
        for key, value in data.items():
            if key != "method" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"speculative_config {key} must be an integer, got {value!r}")
        if "method" not in data or "num_speculative_tokens" not in data:
            raise ValueError("speculative_config needs method and num_speculative_tokens")
        high: int | None = data.get("prompt_lookup_max")
        low: int | None = data.get("prompt_lookup_min")
        if high is None:  # vLLM's: a bound not given is the other one, else both 5
            high = DEFAULT_LOOKUP if low is None else low
        if low is None:
            low = high
        return cls(str(data["method"]), data["num_speculative_tokens"], high, low)


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


@dataclass
class Speculator:
    """Proposes drafts for the scheduler's decode rows and keeps the counters.

    Backoff: a sequence proposes at most one more token than it has been accepting
    (`average_accepted`), so a sequence whose drafts fail costs one extra row,
    not k; at a full batch the scheduler has no rows to spare and nothing is proposed.
    """

    config: SpeculativeConfig
    counters: SpecCounters = field(default_factory=SpecCounters)

    def budget(self, accepted_average: float) -> int:
        return min(self.config.num_speculative_tokens, int(accepted_average) + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        c = self.config
        return propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)


def average_accepted(previous: float, proposed: int, accepted: int) -> float:
    """A sequence's running average (half-life one verification) of the drafts it accepts,
    counting a draft accepted whole as one more (it might have taken a longer one), so a
    sequence whose drafts are all right grows its draft by one each step."""
    return 0.5 * previous + 0.5 * (accepted + (accepted == proposed))
