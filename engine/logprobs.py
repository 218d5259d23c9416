"""The logprobs a sampled row reports, all from one log-softmax of its raw logits.

Owns: the top MAX_LOGPROBS (logprobs / top_logprobs) and the logprobs of the ids a row
names (vLLM's logprob_token_ids). Pure functions, traced inside engine.sampling's
`sample` and the runner's prompt-logprobs program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from engine import rowwise
from engine.types import MAX_LOGPROBS


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
