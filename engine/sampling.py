"""On-device sampling for a batch of rows, each with its own parameters and key.

Owns: penalties, min_tokens, logit bias, the allowed-token bitmask, greedy /
temperature / top-k / top-p in one pass, and when each row's logprobs of the raw
logits are computed (engine.logprobs computes them).
Every row is computed independently of the others and the random draw is
always made over the full vocabulary in token order, so a seeded row samples
the same token whatever shares its batch.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine import rowwise
from engine.logprobs import LogprobsOf, raw_logprobs, when_asked
from engine.token_mask import token_bitmask
from engine.types import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    SamplingParams,
)

CANDIDATES = 64  # top-k / top-p thresholds within this many best tokens avoid a bisection
# A row's counts (engine.core.runner) add this to each token of its prompt when its
# repetition penalty needs them: exact in float32 beside any count of a context (< 2**20).
PROMPT_SEEN = 1 << 20


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters as arrays with a leading batch axis."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; <= 0 = off
    top_p: jax.Array  # float32; 1 = off
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    repetition_penalty: jax.Array  # float32; 1 = off
    min_tokens: jax.Array  # int32
    key: jax.Array  # uint32 (2,): raw threefry key of the request's seed
    logprobs: jax.Array  # bool: the request wants logprobs
    bias_ids: jax.Array  # (MAX_LOGIT_BIAS,) int32; padding INT32_MAX (dropped by the scatter)
    bias_values: jax.Array  # (MAX_LOGIT_BIAS,) float32; padding 0
    allowed: jax.Array  # (mask_words(vocab),) int32 allowed-token bitmask; all ones: every token
    masked: jax.Array  # bool: the bitmask restricts this row
    picked_ids: jax.Array  # (MAX_LOGPROB_TOKEN_IDS,) int32: logprob_token_ids; padding -1


def allowed_words(sampling: SamplingParams, vocab_size: int) -> np.ndarray:
    """The bitmask of a request's first token: allowed_token_ids and, with structured
    outputs, the grammar's first mask, both at once."""
    words = token_bitmask(sampling.allowed_token_ids, vocab_size)
    if sampling.constraint is not None:
        first = np.asarray(sampling.constraint.initial_mask(), np.int32)
        if first.shape != words.shape:
            raise ValueError(f"a constraint mask must be {words.shape} words, got {first.shape}")
        words = words & first
    return words


class Sampled(NamedTuple):
    """One token per row; the logprob fields are filled only when some row wants them."""

    token: jax.Array  # (B,) int32
    logprob: jax.Array  # (B,) float32
    top_ids: jax.Array  # (B, MAX_LOGPROBS) int32
    top_logprobs: jax.Array  # (B, MAX_LOGPROBS) float32
    picked_logprobs: jax.Array  # (B, MAX_LOGPROB_TOKEN_IDS) float32: of each row's picked_ids


def seed_key(seed: int) -> np.ndarray:
    """The raw key PRNGKey(seed) would give (64-bit seeds keep their high word)."""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def host_arrays(sampling: SamplingParams, vocab_size: int) -> SamplingArrays:
    """One request's sampling as host scalars; dtypes and shapes fixed so jit never retraces."""
    if sampling.seed is None:
        raise ValueError("sampling.seed must be set before the engine sees the request")
    bias_ids = np.full((MAX_LOGIT_BIAS,), INT32_MAX, np.int32)
    bias_values = np.zeros((MAX_LOGIT_BIAS,), np.float32)
    for i, (token, bias) in enumerate(sampling.logit_bias):
        bias_ids[i], bias_values[i] = token, bias
    picked_ids = np.full((MAX_LOGPROB_TOKEN_IDS,), -1, np.int32)
    picked = sampling.logprob_token_ids or ()
    picked_ids[: len(picked)] = picked
    host: dict[str, Any] = {  # numpy values: jit takes them where it takes device arrays
        "temperature": np.float32(sampling.temperature),
        "top_k": np.int32(max(sampling.top_k, 0)),
        "top_p": np.float32(sampling.top_p),
        "presence_penalty": np.float32(sampling.presence_penalty),
        "frequency_penalty": np.float32(sampling.frequency_penalty),
        "repetition_penalty": np.float32(sampling.repetition_penalty),
        "min_tokens": np.int32(sampling.min_tokens),
        "key": seed_key(sampling.seed),
        "logprobs": np.bool_(sampling.logprobs is not None),
        "bias_ids": bias_ids,
        "bias_values": bias_values,
        "allowed": allowed_words(sampling, vocab_size),
        "masked": np.bool_(
            sampling.allowed_token_ids is not None or sampling.constraint is not None
        ),
        "picked_ids": picked_ids,
    }
    return SamplingArrays(**host)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (so thresholds can be bisected exactly)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    flipped = bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))
    return lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _bisect(keys: jax.Array, enough: Any) -> jax.Array:
    """Per row, the largest key t with enough(keys >= t) true (it is at least the row's minimum).

    32 halvings of the uint32 range make it exact: no sort of the vocabulary, which
    costs ~100x more on CPU.
    """
    lo = jnp.min(keys, axis=-1)
    hi = jnp.max(keys, axis=-1)

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        ok = enough(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def _filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tokens inside each row's top-k and then top-p nucleus (the top token always is).

    top-k keeps values >= the k-th largest; top-p keeps, of those, the tokens whose
    more probable predecessors hold less than top_p of the mass. A row whose
    threshold lies among its CANDIDATES best tokens reads it off lax.top_k; other
    rows bisect. The choice is per row, so a row's result never depends on its
    batch (the bisection only runs when some row needs it).
    """
    vocab = scaled.shape[-1]
    cand = min(CANDIDATES, vocab)
    keys = _sortable(scaled)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    best, _ = lax.top_k(scaled, cand)
    fast_k = (top_k <= 0) | (k <= cand)
    kth_fast = jnp.where(
        top_k > 0,
        _sortable(jnp.take_along_axis(best, jnp.clip(k - 1, 0, cand - 1)[:, None], -1)[:, 0]),
        jnp.min(keys, axis=-1),
    )
    kth = _per_row(fast_k, kth_fast, lambda: _bisect(keys, lambda up: jnp.sum(up, -1) >= k))
    keep = keys >= kth[:, None]

    probs = rowwise.softmax(jnp.where(keep, scaled, -jnp.inf))
    prob_keys = _sortable(probs)
    best_p, _ = lax.top_k(probs, cand)
    before = jnp.cumsum(best_p, axis=-1) - best_p
    inside = jnp.sum(before < top_p[:, None], axis=-1)
    fast_p = (top_p >= 1.0) | (inside < cand)
    tau_fast = _sortable(jnp.take_along_axis(best_p, (inside - 1)[:, None], -1)[:, 0])
    tau = _per_row(
        fast_p,
        tau_fast,
        lambda: _bisect(prob_keys, lambda up: rowwise.tree_sum(jnp.where(up, probs, 0)) >= top_p),
    )
    nucleus = (prob_keys >= tau[:, None]) | (top_p >= 1.0)[:, None]
    return keep & nucleus


def _per_row(fast: jax.Array, value: jax.Array, slow: Any) -> jax.Array:
    """value where fast, else slow() -- computed only when some row needs it."""
    return lax.cond(jnp.all(fast), lambda: value, lambda: jnp.where(fast, value, slow()))


def _inverse_cdf(probs: jax.Array, uniform: jax.Array, block: int = 256) -> jax.Array:
    """Per row, the token where the CDF first exceeds uniform * total mass.

    Two levels (block sums, then one block) instead of a cumsum over the whole
    vocabulary; the result is clamped to tokens of non-zero probability.
    """
    rows, vocab = probs.shape
    probs = jnp.pad(probs, ((0, 0), (0, -vocab % block)))
    blocks = probs.reshape(rows, -1, block)
    block_cdf = jnp.cumsum(rowwise.tree_sum(blocks), axis=-1)
    target = uniform * block_cdf[:, -1]
    last_block = _last_true(
        block_cdf > jnp.concatenate([jnp.zeros((rows, 1)), block_cdf[:, :-1]], -1)
    )
    b = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), last_block)
    start = jnp.where(
        b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0
    )
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    inner_cdf = start[:, None] + jnp.cumsum(inner, axis=-1)
    i = jnp.minimum(jnp.sum(inner_cdf <= target[:, None], axis=-1), _last_true(inner > 0))
    return (b * block + i).astype(jnp.int32)


def _last_true(mask: jax.Array) -> jax.Array:
    """Index of the last true entry per row (0 when none)."""
    n = mask.shape[-1]
    return (n - 1 - jnp.argmax(mask[:, ::-1], axis=-1)).astype(jnp.int32)


def sample(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
    vocab_major: bool = False,
    count_rows: jax.Array | None = None,
) -> Sampled:
    """Sample one token per row of logits (B, vocab), or of (vocab, B) when vocab_major
    (a decode step's, engine.model.step_logits).

    index (B,): which generated token this is (key = fold_in(key, index));
    counts (>= B, vocab): how often each token was generated so far (penalties;
    rows past B belong to other slots and are never read);
    generated (B,): tokens generated so far (min_tokens); eos_mask (vocab,).
    count_rows (B,): row i's counts are counts[count_rows[i]] (past the end: none), read
    only by the rows that need them; None: counts[i].
    Logprobs (a log-softmax and a top-20 over the vocabulary, ~1 ms of a
    16-slot step of a 32k-vocabulary model on CPU) are computed only when
    some row asks for them (a row that does not ask may get zeros). Likewise
    penalties, min_tokens, logit bias and the allowed-token bitmask cost
    passes over the vocabulary only when some row has them. A batch of plain
    greedy rows runs one argmax and nothing else (its branch returns only
    (B,)-sized arrays: a branch that passes the logits through is a copy of
    them); otherwise every row gets the
    argmax, and only the rows that need more are copied out, GATHERED_ROWS
    at a time, for the passes over the vocabulary. Every row's result
    depends on that row alone, so a row gets the same bits either way, and in
    either layout (vocab-major logits are transposed once when some row needs more
    than the argmax).
    """
    logits = logits.astype(jnp.float32)
    special = (
        penalized(params)
        | (generated < params.min_tokens)
        | (params.temperature > 0)
        | params.logprobs
        | biased(params)
        | params.masked
    )
    if vocab_major:  # (vocab, B): the special rows' passes take the usual layout
        special_rows: Any = lambda t, *rest: _sample_special(
            t.T, *rest, special=special, count_rows=count_rows
        )
        greedy: Any = lambda t, *_: _greedy_tokens(argmax(t, axis=0))
    else:
        special_rows = functools.partial(_sample_special, special=special, count_rows=count_rows)
        greedy = _greedy
    return lax.cond(
        jnp.any(special),
        special_rows,
        greedy,
        logits,
        params,
        index,
        counts,
        generated,
        eos_mask,
    )


GATHERED_ROWS = 4  # special rows sampled together, copied out of the batch


def _sample_special(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
    *,
    special: jax.Array,
    count_rows: jax.Array | None = None,
) -> Sampled:
    """Argmax for every row, then _sample_any over the special rows only, GATHERED_ROWS at a
    time: copied out, sampled, and written back over theirs."""
    rows = logits.shape[0]
    group = min(GATHERED_ROWS, rows)
    count = jnp.sum(special.astype(jnp.int32))
    groups = -(-rows // group)
    picked = jnp.nonzero(special, size=groups * group, fill_value=rows)[0]  # rows: padding

    def one_group(g: jax.Array, out: Sampled) -> Sampled:
        mine = lax.dynamic_slice_in_dim(picked, g * group, group)
        take = jnp.minimum(mine, rows - 1)
        some = _sample_any(
            logits[take],
            jax.tree.map(lambda a: a[take], params),
            index[take],
            counts[take]
            if count_rows is None
            else counts.at[count_rows[take]].get(mode="fill", fill_value=0),
            generated[take],
            eos_mask,
        )
        return Sampled(*(a.at[mine].set(b, mode="drop") for a, b in zip(out, some, strict=True)))

    return lax.fori_loop(0, (count + group - 1) // group, one_group, _greedy(logits))


def _greedy(logits: jax.Array, *_: Any) -> Sampled:
    """What _sample_any gives greedy rows without penalties, logprobs, bias or mask, bit for
    bit."""
    return _greedy_tokens(argmax(logits))


def _greedy_tokens(tokens: jax.Array) -> Sampled:
    rows = tokens.shape[0]
    return Sampled(
        tokens,
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
        jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
        jnp.zeros((rows, MAX_LOGPROB_TOKEN_IDS), jnp.float32),
    )


def _sample_any(
    logits: jax.Array,
    params: SamplingArrays,
    index: jax.Array,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
) -> Sampled:
    adjusting = jnp.any(penalized(params) | (generated < params.min_tokens))
    adjusted = lax.cond(
        adjusting,
        lambda: _adjust(logits, params, counts, generated, eos_mask),
        lambda: logits,  # what _adjust gives a row without penalties or held EOS, bit for bit
    )
    adjusted = lax.cond(
        jnp.any(biased(params)),
        lambda x: add_logit_bias(x, params.bias_ids, params.bias_values),
        lambda x: x,
        adjusted,
    )
    adjusted = lax.cond(  # last, so nothing added after it can lift a disallowed token
        jnp.any(params.masked),
        lambda x: apply_token_bitmask(x, params.allowed),
        lambda x: x,
        adjusted,
    )
    greedy = argmax(adjusted)

    sampling = params.temperature > 0
    drawn = lax.cond(
        jnp.any(sampling),
        lambda: _draw(adjusted, params, index),
        lambda: jnp.zeros(greedy.shape, jnp.int32),
    )
    token = jnp.where(sampling, drawn, greedy)
    return with_logprobs(logits, token, params, raw_logprobs)


def with_logprobs(
    logits: jax.Array, token: jax.Array, params: SamplingArrays, logprobs_of: LogprobsOf
) -> Sampled:
    """The rows' tokens with their logprob fields (engine.logprobs.when_asked)."""
    return Sampled(
        token, *when_asked(logits, token, params.logprobs, params.picked_ids, logprobs_of)
    )


def penalized(params: SamplingArrays) -> jax.Array:
    """Per row, whether a penalty applies (presence, frequency, repetition): counts matter."""
    penalty = (params.presence_penalty != 0) | (params.frequency_penalty != 0)
    return penalty | (params.repetition_penalty != 1)


def biased(params: SamplingArrays) -> jax.Array:
    """Per row, whether a logit bias applies."""
    return jnp.any(params.bias_values != 0, axis=-1)


def add_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits (B, vocab) plus each row's (ids, values) (B, n); ids out of range are dropped,
    so padding (INT32_MAX) changes nothing, bit for bit."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf at every token whose bit is clear in its row's bitmask (B, mask_words(vocab)).

    The one place an allowed-token mask meets the logits: allowed_token_ids
    today, a grammar engine's per-step mask later. A row whose words are all
    ones keeps its logits bit for bit.
    """
    rows, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (B, words, 32): token 32 * word + bit
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _adjust(
    logits: jax.Array,
    params: SamplingArrays,
    counts: jax.Array,
    generated: jax.Array,
    eos_mask: jax.Array,
) -> jax.Array:
    """Penalties in vLLM's order (repetition over every token seen, the prompt's marked
    PROMPT_SEEN in the counts; then presence and frequency over the output's), then EOS
    held back below min_tokens. A row without repetition keeps its logits' bits there."""
    counts_f = counts[: logits.shape[0]].astype(jnp.float32)
    output = jnp.where(counts_f >= PROMPT_SEEN, counts_f - PROMPT_SEEN, counts_f)
    repetition = params.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where((counts_f > 0) & (repetition != 1), repeated, logits)
    adjusted = (
        logits
        - params.presence_penalty[:, None] * (output > 0)
        - params.frequency_penalty[:, None] * output
    )
    hold_eos = (generated < params.min_tokens)[:, None] & eos_mask[None, :]
    return jnp.where(hold_eos, -jnp.inf, adjusted)


def argmax(x: jax.Array, axis: int = 1) -> jax.Array:
    """Per row of a (rows, n) array (axis 1) or column of an (n, rows) one (axis 0), the
    first index of the maximum, as jnp.argmax gives (NaN counts as the maximum).

    In blocks of ARGMAX_BLOCK or so positions when the row length divides into
    them: the first block holding the row's maximum, then the first maximum
    inside it. Over 32 rows of a 128k vocabulary, XLA's CPU backend ran
    jnp.argmax's paired (value, index) reduction in ~10% of the lm_head
    product's time, and a max then a first-index pass in ~90% (the second
    pass's select was materialized); this costs about one max (~1.5%).
    """
    if axis == 0:
        n, rows = x.shape
    else:
        rows, n = x.shape
    block = _argmax_block(n)
    if block is None:
        return jnp.argmax(x, axis=axis).astype(jnp.int32)
    if axis == 0:
        blocks = x.reshape(n // block, block, rows)
        best = jnp.argmax(jnp.max(blocks, axis=1), axis=0).astype(jnp.int32)
        inside = jnp.take_along_axis(blocks, best[None, None, :], axis=0)[0]
        return best * block + jnp.argmax(inside, axis=0).astype(jnp.int32)
    blocks = x.reshape(rows, n // block, block)
    best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(blocks, best[:, None, None], axis=1)[:, 0]
    return best * block + jnp.argmax(inside, axis=-1).astype(jnp.int32)


ARGMAX_BLOCK = 512  # positions per argmax block (a divisor of the vocabulary near this)


def _argmax_block(n: int) -> int | None:
    """The divisor of n nearest ARGMAX_BLOCK within 4x of it, or None (then one pass)."""
    if n <= ARGMAX_BLOCK:
        return None
    divisors = [d for d in range(ARGMAX_BLOCK // 4, 4 * ARGMAX_BLOCK + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - ARGMAX_BLOCK), default=None)


def _draw(adjusted: jax.Array, params: SamplingArrays, index: jax.Array) -> jax.Array:
    """Temperature, top-k, top-p, then one uniform per row through the inverse CDF.

    A row's draw depends only on its logits, parameters and (key, index): the
    filters run whenever any row asks for them, but a row without filters keeps
    every token either way.
    """
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = adjusted / temperature[:, None]
    filtering = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    keep = lax.cond(
        filtering,
        lambda s: _filter_mask(s, params.top_k, params.top_p),
        lambda s: jnp.ones(s.shape, bool),
        scaled,
    )
    probs = rowwise.softmax(jnp.where(keep, scaled, -jnp.inf))
    keys = jax.vmap(jax.random.fold_in)(params.key, index)
    uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    return _inverse_cdf(probs, uniform)
