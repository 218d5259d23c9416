"""The logprobs a sampled row reports, all from one log-softmax of its raw logits.

Owns: the top MAX_LOGPROBS (logprobs / top_logprobs) and the logprobs of the ids a row
names (vLLM's logprob_token_ids). Pure functions, traced inside engine.sampling's
`sample` and the runner's prompt-logprobs program.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from engine import rowwise
from engine.types import MAX_LOGPROB_TOKEN_IDS, MAX_LOGPROBS


def top_logprobs(logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS best (logprob, id) per row, padded with -inf if the vocab is smaller."""
    k = min(MAX_LOGPROBS, logprobs.shape[-1])
    values, ids = lax.top_k(logprobs, k)
    pad = ((0, 0), (0, MAX_LOGPROBS - k))
    return jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)


def raw_logprobs(
    logits: jax.Array, token: jax.Array, picked_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logprob of token, top MAX_LOGPROBS logprobs, their ids, the logprobs of each row's
    picked_ids) of the raw logits, per row: every value read from one log-softmax, so a
    picked id's logprob has the bits the top ones give it. The picked ones are gathered
    only when some row names ids; padding (-1) gives 0, so a row's values never depend on
    its batch."""
    logprobs = rowwise.log_softmax(logits)
    top_lps, top_ids = top_logprobs(logprobs)
    chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    named = picked_ids >= 0
    picked = lax.cond(
        jnp.any(named[:, 0]),
        lambda: jnp.where(
            named, jnp.take_along_axis(logprobs, jnp.maximum(picked_ids, 0), axis=-1), 0.0
        ),
        lambda: jnp.zeros(picked_ids.shape, jnp.float32),
    )
    return chosen, top_lps, top_ids.astype(jnp.int32), picked


Logprobs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
LogprobsOf = Callable[[jax.Array, jax.Array, jax.Array], Logprobs]


def when_asked(
    logits: jax.Array,
    token: jax.Array,
    asked: jax.Array,
    picked_ids: jax.Array,
    logprobs_of: LogprobsOf = raw_logprobs,
) -> Logprobs:
    """`logprobs_of(logits, token, picked_ids)` (a backend's form of `raw_logprobs`, in
    Sampled's order: the token's logprob, the top logprobs, their ids, the picked ids')
    when some row `asked`, zeros (no pass over the logits) when none did."""
    rows = logits.shape[0]
    chosen, top_lps, top_ids, picked = lax.cond(
        jnp.any(asked),
        logprobs_of,
        lambda *_: (
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((rows, MAX_LOGPROB_TOKEN_IDS), jnp.float32),
        ),
        logits,
        token,
        picked_ids,
    )
    return chosen, top_ids, top_lps, picked
