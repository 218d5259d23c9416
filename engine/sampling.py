"""On-device sampling for a batch of rows, each with its own parameters and key.

Owns: penalties, min_tokens, greedy / temperature / top-k / top-p in one pass,
and the logprobs of the raw logits. Every row is computed independently of
the others and the random draw is always made over the full vocabulary in
token order, so a seeded row samples the same token whatever shares its batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.types import MAX_LOGPROBS, SamplingParams


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters as arrays with a leading batch axis."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; <= 0 = off
    top_p: jax.Array  # float32; 1 = off
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    min_tokens: jax.Array  # int32
    key: jax.Array  # uint32 (2,): raw threefry key of the request's seed


class Sampled(NamedTuple):
    token: jax.Array  # (B,) int32
    logprob: jax.Array  # (B,) float32
    top_ids: jax.Array  # (B, MAX_LOGPROBS) int32
    top_logprobs: jax.Array  # (B, MAX_LOGPROBS) float32


def seed_key(seed: int) -> np.ndarray:
    """The raw key PRNGKey(seed) would give (64-bit seeds keep their high word)."""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def host_arrays(sampling: SamplingParams) -> SamplingArrays:
    """Scalar (unbatched) host arrays of one request's sampling; dtypes fixed so jit never retraces."""
    if sampling.seed is None:
        raise ValueError("sampling.seed must be set before the engine sees the request")
    return SamplingArrays(
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(max(sampling.top_k, 0)),
        top_p=np.float32(sampling.top_p),
        presence_penalty=np.float32(sampling.presence_penalty),
        frequency_penalty=np.float32(sampling.frequency_penalty),
        min_tokens=np.int32(sampling.min_tokens),
        key=seed_key(sampling.seed),
    )


def _top_logprobs(logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS best (logprob, id) per row, padded with -inf if the vocab is smaller."""
    k = min(MAX_LOGPROBS, logprobs.shape[-1])
    values, ids = lax.top_k(logprobs, k)
    pad = ((0, 0), (0, MAX_LOGPROBS - k))
    return jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)


def _filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tokens inside each row's top-k and top-p nucleus (the top token always is)."""
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_k, ordered, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (before < top_p[:, None])
    kept = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    return scaled >= threshold


def sample(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
) -> Sampled:
    """Sample one token per row of logits (B, vocab).

    index (B,): which generated token this is (key = fold_in(key, index));
    counts (B, vocab): how often each token was generated so far (penalties);
    generated (B,): tokens generated so far (min_tokens); eos_mask (vocab,).
    """
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = _top_logprobs(logprobs)
    counts_f = counts.astype(jnp.float32)
    adjusted = (
        logits
        - params.presence_penalty[:, None] * (counts_f > 0)
        - params.frequency_penalty[:, None] * counts_f
    )
    hold_eos = (generated < params.min_tokens)[:, None] & eos_mask[None, :]
    adjusted = jnp.where(hold_eos, -jnp.inf, adjusted)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)

    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = adjusted / temperature[:, None]
    filtering = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    keep = lax.cond(
        filtering,
        lambda s: _filter_mask(s, params.top_k, params.top_p),
        lambda s: jnp.ones(s.shape, bool),
        scaled,
    )
    keys = jax.vmap(jax.random.fold_in)(params.key, index)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
    token = jnp.where(params.temperature > 0, drawn.astype(jnp.int32), greedy)
    logprob = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    return Sampled(token, logprob, top_ids.astype(jnp.int32), top_logprobs)
