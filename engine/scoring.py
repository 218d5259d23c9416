"""Scoring a fixed text through the engine core as it serves: teacher-forced logprobs.

Owns: `score`, which runs a token sequence as one prompt through an `EngineCore` with
prompt logprobs and returns, for every position, the logprob of the token that follows
and the best token there. The same path a request with `prompt_logprobs` takes (chunks,
pages, the backend's attention, the configured dtype, quantization and KV dtype), so
perplexity and agreement with a reference measure what is served. Used by
tests/engine/test_real_model.py and bench/quality.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.core import EngineCore
from engine.core.sequence import SequenceState as CoreSequence
from engine.types import SamplingParams


@dataclass(frozen=True)
class Scores:
    """Per position p of a text (all but the last): token p + 1's logprob, the best token."""

    logprobs: np.ndarray  # (n - 1,) float32
    best: np.ndarray  # (n - 1,) int32

    @property
    def perplexity(self) -> float:
        return math.exp(-float(np.mean(self.logprobs.astype(np.float64))))


def score(core: EngineCore, tokens: Sequence[int], seq_id: str = "score") -> Scores:
    """The text's scores from `core` (idle: this steps it until the text is done)."""
    if len(tokens) < 2:
        raise ValueError("scoring needs at least 2 tokens")
    greedy = SamplingParams(temperature=0.0, seed=0)
    core.add(CoreSequence(seq_id, tuple(tokens), greedy, 1, prompt_logprobs=1))
    first = None
    while core.scheduler.busy:
        for event in core.step():
            if event.seq_id == seq_id and first is None:
                first = event
    if first is None or first.prompt_logprobs is None:
        raise RuntimeError(f"{seq_id}: the core returned no prompt logprobs")
    entries = first.prompt_logprobs[1:]
    logprobs = np.array([e.logprob for e in entries if e is not None], np.float32)
    best = np.array([e.top[0][0] for e in entries if e is not None], np.int32)
    if len(logprobs) != len(tokens) - 1:
        raise RuntimeError(f"{seq_id}: {len(logprobs)} scored positions of {len(tokens) - 1}")
    return Scores(logprobs, best)
