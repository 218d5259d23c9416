"""The pure-JAX ragged paged attention that defines correctness.

Owns: `Attention` (the seam every backend implements) and `ReferenceAttention`.
Receives a ragged batch's queries (T, heads, head_dim) with its `AttentionBatch`,
and the layer's pages with this step's K/V already written; emits (T, heads,
head_dim). Each query sees the positions of its own sequence up to its own
(causal; and within the sliding window), scores in float32.

Plain and exact rather than fast: every query gathers its sequence's whole page
list, (T, pages_per_seq * page_size) positions. The CPU and GPU backends run it
today; a faster form per backend must match it.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from engine.attention.layout import AttentionBatch, KVLayout

F32 = jnp.float32


class Attention(Protocol):
    """One backend: writes a step's K/V into pages and attends over them."""

    layout: KVLayout

    def any_form_bits(self, heads: int) -> bool:
        """Whether a query's output bits are the same whatever form its sequence runs in
        (a decode row, or any chunk of a prompt, beginning anywhere); then a prefix hit
        may end anywhere (engine.core.scheduler)."""
        ...

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        """Pages with the step's keys and values (T, kv_heads, head_dim) at `slots`."""
        ...

    def attend(
        self,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        sliding_window: int | None = None,
    ) -> jax.Array:
        """Each query's attention over its sequence's positions: (T, heads, head_dim)."""
        ...


def query_positions(t: int, batch: AttentionBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each of t queries: its sequence, its position, and whether it is real."""
    token = jnp.arange(t, dtype=jnp.int32)
    # as jax arrays: a batch built on the host (numpy) is indexed by traced values here
    cu, kv_lens = jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.kv_lens)
    seqs = kv_lens.shape[0]
    seq = jnp.searchsorted(cu[1:], token, side="right").astype(jnp.int32)
    real = token < cu[jnp.asarray(batch.num_seqs)[0]]
    seq = jnp.minimum(seq, seqs - 1)
    position = kv_lens[seq] - (cu[seq + 1] - token)
    return seq, position, real


def causal_probs(
    scores: jax.Array, position: jax.Array, real: jax.Array, window: int | None
) -> jax.Array:
    """Scores (T, kv_heads, groups, positions) -> each query's softmax over the positions
    it sees (at or before its own, within the window; none for padding queries: zeros)."""
    k_pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)[None, :]
    seen = k_pos <= position[:, None]
    if window is not None:
        seen = seen & (k_pos > position[:, None] - window)
    seen = seen & real[:, None]
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(probs, axis=-1, keepdims=True)
    return probs / jnp.where(total > 0, total, 1.0)


class ReferenceAttention:
    """Attention as the definition: gather, mask, softmax in float32."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def any_form_bits(self, heads: int) -> bool:
        return False  # a chunk's queries are computed together, in shapes of its size

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        return self.layout.write(pages, k, v, slots)

    def attend(
        self,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        sliding_window: int | None = None,
    ) -> jax.Array:
        layout = self.layout
        t, heads, dim = q.shape
        groups = heads // layout.kv_heads
        seq, position, real = query_positions(t, batch)
        own = pages[batch.page_indices[seq]]  # (T, pages_per_seq, page_size, ...)
        own = own.reshape(t, -1, *own.shape[-2:])
        keys, values = layout.unpack(own)  # (T, L, kv_heads, head_dim); 8-bit: float32
        qg = q.reshape(t, layout.kv_heads, groups, dim)
        scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys, preferred_element_type=F32)
        scores = scores * (dim**-0.5)
        probs = causal_probs(scores, position, real, sliding_window).astype(q.dtype)
        out = jnp.einsum("tkgl,tlkd->tkgd", probs, values, preferred_element_type=F32)
        return out.astype(q.dtype).reshape(t, heads, dim)
