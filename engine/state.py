"""The fixed-shape decode state and the pure functions that move it forward.

Owns: `DecodeState` (KV cache plus per-slot length, next token, sampling
parameters, key, counters and active flag) and `insert_prefix`, `free_slot`,
`decode_step`. Shapes never change while serving, so each function compiles
once (insert once per prefill bucket).

Invariant: for a busy slot, cache positions < lengths[slot] hold the KV of
every token so far, and tokens[slot] is the last sampled token, whose KV is
written by the next step at position lengths[slot].

The cache is split along positions into equal chunks, one array each, so a
step reads only the chunks some busy slot has reached (see
engine.model._attend_live) without slicing a buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from engine.config import ModelConfig
from engine.model import Params, decode_forward, key_block, key_blocks
from engine.sampling import Sampled, SamplingArrays, mask_words, penalized, sample
from engine.types import INT32_MAX, MAX_LOGIT_BIAS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    k_cache: tuple[tuple[jax.Array, ...], ...]  # per layer, chunk: (slots, kv, blocks, dim, block)
    v_cache: tuple[tuple[jax.Array, ...], ...]  # per layer, chunk: (slots, kv, chunk, head_dim)
    lengths: jax.Array  # (slots,) int32: tokens whose KV is cached
    tokens: jax.Array  # (slots,) int32: last sampled token, fed next
    generated: jax.Array  # (slots,) int32: tokens sampled so far (prefill's included)
    counts: jax.Array  # (slots, vocab) int32: tokens sampled, kept while penalties use them
    sampling: SamplingArrays  # each field with a leading slots axis
    active: jax.Array  # (slots,) bool


def empty_state(
    cfg: ModelConfig, slots: int, max_len: int, dtype: jnp.dtype, chunk: int
) -> DecodeState:
    """All slots idle; room for max_len positions in chunks of `chunk` (the last may overhang)."""
    chunks = math.ceil(max_len / chunk)
    block = key_block(chunk)
    k_shape = (slots, cfg.num_kv_heads, chunk // block, cfg.head_dim, block)
    v_shape = (slots, cfg.num_kv_heads, chunk, cfg.head_dim)

    def layer(shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(shape, dtype) for _ in range(chunks))

    zeros_i = jnp.zeros((slots,), jnp.int32)
    zeros_f = jnp.zeros((slots,), jnp.float32)
    return DecodeState(
        k_cache=tuple(layer(k_shape) for _ in range(cfg.num_layers)),
        v_cache=tuple(layer(v_shape) for _ in range(cfg.num_layers)),
        lengths=zeros_i,
        tokens=zeros_i,
        generated=zeros_i,
        counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
        sampling=SamplingArrays(
            temperature=zeros_f,
            top_k=zeros_i,
            top_p=jnp.ones((slots,), jnp.float32),
            presence_penalty=zeros_f,
            frequency_penalty=zeros_f,
            min_tokens=zeros_i,
            key=jnp.zeros((slots, 2), jnp.uint32),
            logprobs=jnp.zeros((slots,), bool),
            bias_ids=jnp.full((slots, MAX_LOGIT_BIAS), INT32_MAX, jnp.int32),
            bias_values=jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.float32),
            allowed=jnp.full((slots, mask_words(cfg.vocab_size)), -1, jnp.int32),
            masked=jnp.zeros((slots,), bool),
        ),
        active=jnp.zeros((slots,), bool),
    )


def insert_prefix(
    state: DecodeState,
    slot: jax.Array,
    k: tuple[jax.Array, ...],
    v: tuple[jax.Array, ...],
    length: jax.Array,
    token: jax.Array,
    sampling: SamplingArrays,
) -> DecodeState:
    """Put a prefilled prompt (per layer k: (kv_heads, head_dim, bucket), v: (kv_heads,
    bucket, head_dim)) into positions 0..bucket-1 of `slot`.

    A bucket of any length fills whole chunks and then the start of one more.
    Keys longer than a key block are padded with zeros to whole blocks first
    (positions past the prompt are rewritten by decode before any step sees
    them); the cache's capacity is a whole number of chunks, so they fit.
    """
    size = state.v_cache[0][0].shape[2]
    block = state.k_cache[0][0].shape[-1]

    def put(
        chunks: tuple[jax.Array, ...], prompt: jax.Array, axis: int, keys: bool
    ) -> tuple[jax.Array, ...]:
        if keys and prompt.shape[axis] > block:
            pad = [(0, 0)] * prompt.ndim
            pad[axis] = (0, -prompt.shape[axis] % block)
            prompt = jnp.pad(prompt, pad)
        bucket = prompt.shape[axis]
        pieces = [
            lax.slice_in_dim(prompt, i * size, min(bucket, (i + 1) * size), axis=axis)
            for i in range(math.ceil(bucket / size))
        ]
        if keys:
            pieces = [key_blocks(piece, block) for piece in pieces]
        written = tuple(
            lax.dynamic_update_slice(c, piece[None].astype(c.dtype), (slot,) + (0,) * piece.ndim)
            for c, piece in zip(chunks, pieces, strict=False)
        )
        return written + chunks[len(pieces) :]

    k_cache = tuple(put(c, p, 2, True) for c, p in zip(state.k_cache, k, strict=True))
    v_cache = tuple(put(c, p, 1, False) for c, p in zip(state.v_cache, v, strict=True))
    vocab = state.counts.shape[1]
    first_count = (jnp.arange(vocab) == token).astype(jnp.int32)
    return DecodeState(
        k_cache=k_cache,
        v_cache=v_cache,
        lengths=state.lengths.at[slot].set(length),
        tokens=state.tokens.at[slot].set(token),
        generated=state.generated.at[slot].set(1),
        counts=state.counts.at[slot].set(first_count),
        sampling=jax.tree.map(lambda a, s: a.at[slot].set(s), state.sampling, sampling),
        active=state.active.at[slot].set(True),
    )


def write_masks(
    allowed: jax.Array, masked: jax.Array, slots: jax.Array, rows: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The sampling state's bitmask (slots, words) and masked flags (slots,) with rows
    `slots` (padding: out of range, dropped) set to `rows` and marked: constrained slots'
    masks for their next token. Only these two arrays go in and out, so the call costs a
    dispatch of two buffers, not of the whole decode state."""
    return allowed.at[slots].set(rows, mode="drop"), masked.at[slots].set(True, mode="drop")


def free_slot(state: DecodeState, slot: jax.Array) -> DecodeState:
    return _replace(state, active=state.active.at[slot].set(False))


def _replace(state: DecodeState, **changes: jax.Array) -> DecodeState:
    fields = {name: getattr(state, name) for name in state.__dataclass_fields__}
    return DecodeState(**(fields | changes))


def decode_step(
    params: Params,
    state: DecodeState,
    inv_freq: jax.Array,
    eos_mask: jax.Array,
    cfg: ModelConfig,
    max_len: int,
    rows: int | None = None,
) -> tuple[DecodeState, Sampled, jax.Array, jax.Array]:
    """Feed the first `rows` slots' last tokens (default: every slot), sample the next
    -> (state, sampled, active, logits).

    sampled and active cover every slot (zeros / False past `rows`); logits
    are (rows, vocab), or (vocab, rows) with cfg.vocab_major_head. Slots past
    `rows` are not computed and every part of their state stays as it was, so a
    caller steps a bucket that covers every busy slot. Idle slots inside it
    compute too but their length, token and counters stay put; they sit at
    position 0, so they never make the step read more of the cache. A slot that
    reaches max_len becomes idle.
    """
    slots = state.lengths.shape[0]
    rows = slots if rows is None else rows

    def head(a: jax.Array) -> jax.Array:
        return a if rows == slots else a[:rows]

    def put(full: jax.Array, part: jax.Array) -> jax.Array:
        return part if rows == slots else lax.dynamic_update_slice_in_dim(full, part, 0, 0)

    active, lengths, tokens = head(state.active), head(state.lengths), head(state.tokens)
    generated, sampling = head(state.generated), jax.tree.map(head, state.sampling)
    positions = jnp.where(active, jnp.minimum(lengths, max_len - 1), 0)
    logits, k_cache, v_cache = decode_forward(
        params, tokens, positions, state.k_cache, state.v_cache, inv_freq, cfg
    )
    out = sample(
        logits, sampling, generated, state.counts, generated, eos_mask, cfg.vocab_major_head
    )
    step = active.astype(jnp.int32)
    # Only penalties read the counts: a slot without them may keep stale ones (insert resets).
    new_counts = lax.cond(
        jnp.any(active & penalized(sampling)),
        lambda counts: counts.at[jnp.arange(rows), out.token].add(step),
        lambda counts: counts,
        state.counts,
    )
    lengths = lengths + step
    new_state = DecodeState(
        k_cache=k_cache,
        v_cache=v_cache,
        lengths=put(state.lengths, lengths),
        tokens=put(state.tokens, jnp.where(active, out.token, tokens)),
        generated=put(state.generated, generated + step),
        counts=new_counts,
        sampling=state.sampling,
        active=put(state.active, active & (lengths < max_len)),
    )
    every_slot = jax.tree.map(lambda a: put(jnp.zeros((slots, *a.shape[1:]), a.dtype), a), out)
    return new_state, every_slot, put(jnp.zeros((slots,), bool), active), logits
