"""TPU sampling: a sampled row draws from a prefix of its best tokens.

Owns: `sample` in TPU's form and `backend_sampler`, the one choice of sampler per
backend (the runner's step and bench.tpu_aot both ask it), and the named scopes of its
logit-bias and allowed-token branches (`BIAS_SCOPE`, `MASK_SCOPE`: metadata only, by
which bench.tpu_aot finds them in the compiled program). engine.sampling stays the
definition elsewhere (CPU's bit-exact forms: fixed-order tree sums, a top-k / top-p
bisection over the vocabulary when a threshold lies past its candidates).

Here a sampled row takes its TOP_CANDIDATES best tokens (one lax.top_k pass over the
vocabulary, as vLLM TPU and tpu-inference do) and applies temperature, top-k, top-p and
the draw to that prefix only: the tail past it is never drawn (a row asking a larger
top-k gets TOP_CANDIDATES). Sums are XLA's own reduce (on TPU its order follows the
reduced axis, not the rows). Greedy rows, penalties, min_tokens, logit bias, the
allowed-token bitmask and logprobs mean what they mean in engine.sampling; each costs
its passes over (rows x vocab) only when some row has it. A row's result depends on
that row alone. bench/README.md ("TPU programs") has what it saves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from engine import sampling
from engine.logprobs import top_logprobs
from engine.sampling import Sampled, SamplingArrays

TOP_CANDIDATES = 128  # the tokens a sampled row draws from
# Named scopes of the logit-bias and allowed-token branches (names in the compiled
# program's metadata only): bench.tpu_aot finds them there to count a batch without them.
BIAS_SCOPE = "sampling_logit_bias"
MASK_SCOPE = "sampling_allowed_tokens"


def backend_sampler(platform: str) -> Callable[..., Sampled]:
    """The step's sampler on a platform ("tpu": this module's; else engine.sampling's)."""
    return sample if platform == "tpu" else sampling.sample


def sample(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
    count_rows: jax.Array | None = None,
) -> Sampled:
    """engine.sampling.sample's contract over (B, vocab) logits, in TPU's form."""
    logits = logits.astype(jnp.float32)
    special = (
        sampling.penalized(params)
        | (generated < params.min_tokens)
        | (params.temperature > 0)
        | params.logprobs
        | sampling.biased(params)
        | params.masked
    )
    rows = functools.partial(_special_rows, count_rows=count_rows)
    return lax.cond(
        jnp.any(special), rows, sampling._greedy, logits, params, index, counts, generated, eos_mask
    )


def _special_rows(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
    *,
    count_rows: jax.Array | None,
) -> Sampled:
    rows = logits.shape[0]

    def adjust() -> jax.Array:
        # each row's counts as a one-hot product (exact: one nonzero term each): one read
        # of the table, where XLA's row gather costs ~19 passes over the rows read
        which = jnp.arange(rows, dtype=jnp.int32) if count_rows is None else count_rows
        pick = (which[:, None] == jnp.arange(counts.shape[0])[None, :]).astype(jnp.float32)
        mine = jnp.dot(pick, counts.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return sampling._adjust(logits, params, mine, generated, eos_mask)

    adjusting = jnp.any(sampling.penalized(params) | (generated < params.min_tokens))
    adjusted = lax.cond(adjusting, adjust, lambda: logits)

    def bias(x: jax.Array) -> jax.Array:
        with jax.named_scope(BIAS_SCOPE):
            return sampling.add_logit_bias(x, params.bias_ids, params.bias_values)

    def mask(x: jax.Array) -> jax.Array:
        with jax.named_scope(MASK_SCOPE):
            return apply_token_bitmask(x, params.allowed)

    adjusted = lax.cond(jnp.any(sampling.biased(params)), bias, lambda x: x, adjusted)
    adjusted = lax.cond(jnp.any(params.masked), mask, lambda x: x, adjusted)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)  # XLA's reduce: one pass
    drawing = params.temperature > 0
    drawn = lax.cond(
        jnp.any(drawing),
        lambda: draw(adjusted, params, index),
        lambda: jnp.zeros(greedy.shape, jnp.int32),
    )
    token = jnp.where(drawing, drawn, greedy)
    return sampling.with_logprobs(logits, token, params, _logprobs)


def draw(adjusted: jax.Array, params: SamplingArrays, index: jax.Array) -> jax.Array:
    """Temperature, then top-k and top-p within the row's TOP_CANDIDATES best tokens,
    then one uniform per row (the key engine.sampling derives) through their CDF."""
    vocab = adjusted.shape[-1]
    width = min(TOP_CANDIDATES, vocab)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    values, ids = lax.top_k(adjusted / temperature[:, None], width)  # best first
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, width), width)
    values = jnp.where(position < k[:, None], values, -jnp.inf)
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
    probs = jnp.where((before < params.top_p[:, None]) | (position == 0), probs, 0.0)
    keys = jax.vmap(jax.random.fold_in)(params.key, index)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    cdf = jnp.cumsum(probs, axis=-1)
    last = jnp.sum((probs > 0).astype(jnp.int32), axis=-1) - 1  # kept tokens lead
    choice = jnp.minimum(jnp.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1), last)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _logprobs(
    logits: jax.Array, token: jax.Array, picked_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """engine.logprobs.raw_logprobs' four values from the raw logits: the best logits less
    the row's logsumexp (no log-softmax of the whole row written), and each picked id's
    logit less it (padding, -1, gives 0)."""
    total = jax.nn.logsumexp(logits, axis=-1)
    best, ids = top_logprobs(logits)  # the logits' order is the logprobs'
    chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - total
    named = picked_ids >= 0
    at = jnp.take_along_axis(logits, jnp.maximum(picked_ids, 0), axis=-1) - total[:, None]
    picked = jnp.where(named, at, 0.0)
    return chosen, best - total[:, None], ids.astype(jnp.int32), picked


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """engine.sampling.apply_token_bitmask's result in whole 128-lane rows: each lane of a
    row of 128 tokens takes the byte of its word that holds its bit through a product with
    a 0/1 matrix (exact: one nonzero term, a byte, per lane), where spreading each word
    to 32 lanes would be a relayout of every row (~14 passes over it in XLA's count)."""
    rows, vocab = logits.shape
    groups = -(-vocab // 128)  # 128 tokens: 4 words, 16 bytes
    words = jnp.pad(bitmask, ((0, 0), (0, 4 * groups - bitmask.shape[1])))
    shifts = jnp.arange(0, 32, 8, dtype=jnp.int32)
    octets = ((words[:, :, None] >> shifts) & 255).reshape(rows, groups, 16)
    lane = jnp.arange(128, dtype=jnp.int32)
    spread = lane[None, :] // 8 == jnp.arange(16, dtype=jnp.int32)[:, None]  # (16, 128)
    per_lane = jnp.einsum(
        "rgk,kl->rgl",
        octets.astype(jnp.bfloat16),  # 0..255: exact
        spread.astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    ).astype(jnp.int32)
    bits = ((per_lane >> (lane % 8)) & 1).reshape(rows, groups * 128)[:, :vocab]
    return jnp.where(bits == 1, logits, -jnp.inf)
