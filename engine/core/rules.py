"""The token rules: what a sampled token does to its sequence, decided once, in the core.

Runs on: the core loop's thread, called by the scheduler as it takes each sampled token.
Owns: grammar completion (`advance_grammar`) and every other rule that ends a sample
(`finish_reason`: stop token ids and EOS after min_tokens, the budget). Receives a
sequence that has just appended its token; emits the verdict that crosses to the HTTP
side with the token (engine.core.messages.TokenOut: finish, stop_reason, done, error).
The HTTP side applies stop strings only (tokenization.stream).
"""

from __future__ import annotations

import numpy as np

from engine.core.sequence import SequenceState


def advance_grammar(seq: SequenceState, token: int, base: np.ndarray) -> tuple[bool, str | None]:
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


def finish_reason(
    seq: SequenceState, token: int, max_model_len: int
) -> tuple[str | None, int | None]:
    """(finish reason, stop token id) of the token seq just appended: the one definition of
    the token rules (the grammar's completion aside, decided first by `advance_grammar`).

    A stop token (the request's, then EOS unless ignored) ends the sample only once
    min_tokens tokens came before it: vLLM masks stop tokens while fewer than min_tokens
    were generated, so the earliest a stop token can end a sample is as token min_tokens + 1.
    The request's stop ids come first (stop_reason: the id), EOS after (stop_reason None);
    otherwise the budget (max_tokens, or the context) ends it with "length".
    """
    if len(seq.output) > seq.sampling.min_tokens:
        if token in seq.stop_token_ids:
            return "stop", token
        if token in seq.eos_token_ids:
            return "stop", None
    if budget_spent(seq, len(seq.output), len(seq.tokens), max_model_len):
        return "length", None
    return None, None


def budget_spent(seq: SequenceState, outputs: int, length: int, max_model_len: int) -> bool:
    """The length rule: a sample with `outputs` tokens and `length` in all (prompt and
    output) has spent its budget: max_tokens, or the context. The scheduler asks it ahead
    too, counting the token the step in flight samples."""
    return outputs >= seq.max_tokens or length >= max_model_len
