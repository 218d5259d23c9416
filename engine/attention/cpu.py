"""XLA:CPU attention over the paged KV cache: reading only live pages.

Owns: `CpuAttention`, the CPU backend of the `Attention` seam. Receives a ragged batch's
queries (T, heads, head_dim), the layer's pages with this step's K/V written, and the
`AttentionBatch`; emits (T, heads, head_dim) matching engine.attention.reference
(scores and softmax in float32; padding queries give zeros). 8-bit pages are decoded
block by block as they are read (KVLayout.decode), never as a whole cache.

With float32 or bfloat16 pages every query, decode row or prompt chunk's, runs through
engine.attention.cpu_kernel, reading its pages in place, each query in one fixed order
of its own (`any_form_bits`). Otherwise (float16 and 8-bit pages, or `kernel=False`), work
comes in units of fixed shape, each run by a loop whose trip count is its own live key
blocks (an online softmax over blocks of whole pages):
- decode groups: sequences of one query, wherever they stand in the batch, GROUP_ROWS
  rows at a time, each row reading its own pages, DECODE_BLOCK_TOKENS positions an
  iteration (small blocks keep a group's gathered keys in cache);
- query tiles: TILE_QUERIES consecutive queries of one sequence of many (a prompt
  chunk), TILE_BLOCK_TOKENS positions an iteration, reading only the blocks up to its
  last query (causal) and in the window.
Only units holding real queries run, so neither the bucket (T, S) nor the page table's
length sets the work, and no bound of the scheduler's is needed for correctness.

Bit-exactness of the units: which unit a sequence runs in depends on its own query
count only; a unit's arithmetic has the same shapes in every batch (a bucket of fewer
than GROUP_ROWS sequences runs smaller groups, and XLA's batched products give a batch
element the same bits whatever their count: tests/engine/test_attention_cpu.py holds it
to that); blocks are aligned to absolute positions; a sum over a block is a fixed tree
of adds (XLA's reduce orders its adds by the array's shape); and a fully masked block
leaves the online softmax state bit-identical. So a sequence's output bits depend on
neither the other sequences, the padding, the bucket, nor how many blocks its unit's
loop ran.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from engine.attention import cpu_kernel
from engine.attention.layout import AttentionBatch, KVLayout
from engine.attention.reference import query_positions
from engine.rowwise import tree_sum

F32 = jnp.float32
NEG_INF = -jnp.inf
GROUP_ROWS = 8  # decode rows per group: one shape for every bucket, cache-sized blocks
TILE_QUERIES = 128  # queries of a chunk per tile: a chunk's tail wastes at most this
# Chunks smaller than this still get tiles this big: with 16-query tiles XLA:CPU gave a
# query other bits in programs of other token counts (tests/engine/core/test_core.py).
MIN_TILE_QUERIES = 32
DECODE_BLOCK_TOKENS = 32  # positions a decode group reads per row an iteration (whole pages)
TILE_BLOCK_TOKENS = 128  # positions a query tile reads an iteration (whole pages)

Carry = tuple[jax.Array, jax.Array, jax.Array]


def online_update(carry: Carry, scores: jax.Array, seen: jax.Array) -> tuple[Carry, jax.Array]:
    """One block of scores into the (max, sum, acc) state: the state with acc rescaled,
    and the block's probabilities, whose product with the values the caller adds to acc.

    A fully masked block keeps every bit of the state: its max is -inf, so the running
    max is unchanged, its probabilities are 0 and the correction is exactly 1.
    """
    top, total, acc = carry
    scores = jnp.where(seen, scores, NEG_INF)
    new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
    # a row that has seen nothing yet keeps -inf as its max: exponentiate against 0
    base = jnp.where(new_top == NEG_INF, 0.0, new_top)
    probs = jnp.exp(scores - base[..., None])
    correction = jnp.where(top == new_top, 1.0, jnp.exp(top - base))
    total = total * correction + tree_sum(probs)
    return (new_top, total, acc * correction[..., None]), probs


def finish(total: jax.Array, acc: jax.Array) -> jax.Array:
    """Normalized output; a row that saw no key (padding) gives zeros."""
    return acc / jnp.where(total > 0, total, 1.0)[..., None]


class CpuAttention:
    """Paged attention for XLA:CPU: decode groups and query tiles over live blocks.

    `chunk_size` and `max_prefill_seqs` are the scheduler's bounds on a step's prompt
    chunks. Any ragged batch is attended correctly, so they size no buffer: chunk_size
    only caps the tile (no chunk needs a bigger one), down to MIN_TILE_QUERIES. The
    sizes after them are for tests and bench.attention_bench; bits match across batches
    for one choice of them.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        chunk_size: int,
        max_prefill_seqs: int,
        group_rows: int = GROUP_ROWS,
        tile_queries: int = TILE_QUERIES,
        decode_block_tokens: int = DECODE_BLOCK_TOKENS,
        tile_block_tokens: int = TILE_BLOCK_TOKENS,
        kernel: bool = True,
    ) -> None:
        if layout.fold != 1:
            raise ValueError(f"the CPU backend keeps fold 1, got {layout.fold}")
        if max_prefill_seqs < 0:  # 0: as many as the step's token budget takes
            raise ValueError(f"max_prefill_seqs must be >= 0, got {max_prefill_seqs}")
        for name, value in (
            ("chunk_size", chunk_size),
            ("group_rows", group_rows),
            ("tile_queries", tile_queries),
            ("decode_block_tokens", decode_block_tokens),
            ("tile_block_tokens", tile_block_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.layout = layout
        self.chunk_size = chunk_size
        self.max_prefill_seqs = max_prefill_seqs
        self.group_rows = group_rows
        self.tile_queries = min(tile_queries, max(chunk_size, MIN_TILE_QUERIES))
        self.decode_pages = max(1, decode_block_tokens // layout.page_size)
        self.tile_pages = max(1, tile_block_tokens // layout.page_size)
        self.kernel = kernel  # where usable: engine.attention.cpu_kernel, for every row

    def any_form_bits(self, heads: int) -> bool:
        """Whether every query runs through engine.attention.cpu_kernel (float32 or
        bfloat16 pages):
        then a query's bits are the same whether its sequence runs as a decode row or
        in any chunk."""
        return self.kernel and cpu_kernel.usable(self.layout, heads)

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
        t, heads, dim = q.shape
        if self.any_form_bits(heads):
            # every query row, decode or prompt, reading its sequence's pages in place
            seq, position, live = query_positions(t, batch)
            lens = jnp.where(live, position + 1, 0)
            table = jnp.asarray(batch.page_indices, jnp.int32)
            out = cpu_kernel.query_attention(q, lens, seq, table, pages, sliding_window)
            return out.astype(q.dtype)
        s = batch.kv_lens.shape[0]
        cu = jnp.asarray(batch.cu_q_lens, jnp.int32)
        q_lens = cu[1:] - cu[:-1]
        real = jnp.arange(s) < jnp.asarray(batch.num_seqs, jnp.int32)[0]
        group_rows = min(self.group_rows, t, s)  # a bucket of fewer rows runs smaller groups
        tile_queries = self.tile_queries
        # index s stands for no sequence: no positions, its query row past the batch
        kv_lens = jnp.pad(jnp.asarray(batch.kv_lens, jnp.int32), (0, 1))
        first_row = jnp.pad(cu[:-1], (0, 1), constant_values=t)
        table = jnp.asarray(batch.page_indices, jnp.int32)
        whole = math.lcm(self.decode_pages, self.tile_pages)  # whole blocks: the tail reads page 0
        table = jnp.pad(table, ((0, 1), (0, -table.shape[1] % whole)))
        span = max(group_rows, tile_queries)
        padded_q = jnp.pad(q, ((0, span), (0, 0), (0, 0)))
        out = jnp.zeros((t + span, heads, dim), q.dtype)

        # sequences of many queries (prompt chunks) in tiles, in token order
        tiles = jnp.where(real & (q_lens > 1), (q_lens + tile_queries - 1) // tile_queries, 0)
        ends = jnp.cumsum(tiles)

        def tile(u: jax.Array, out: jax.Array) -> jax.Array:
            seq = jnp.searchsorted(ends, u, side="right").astype(jnp.int32)
            i = u - (ends[seq] - tiles[seq])
            start = cu[seq] + i * tile_queries
            part = self._query_tile(
                lax.dynamic_slice(padded_q, (start, 0, 0), (tile_queries, heads, dim)),
                pages,
                jnp.minimum(q_lens[seq] - i * tile_queries, tile_queries),
                kv_lens[seq] - q_lens[seq] + i * tile_queries,
                table[seq],
                sliding_window,
            )
            # its rows past the sequence are zeros, on later tiles' rows or on padding
            return lax.dynamic_update_slice(out, part.astype(out.dtype), (start, 0, 0))

        out = lax.fori_loop(0, ends[-1], tile, out)

        single = real & (q_lens == 1)
        # sequences of one query (decode rows, wherever they stand) in groups
        order = jnp.nonzero(single, size=s + group_rows, fill_value=s)[0].astype(jnp.int32)

        def group(i: jax.Array, out: jax.Array) -> jax.Array:
            seqs = lax.dynamic_slice(order, (i * group_rows,), (group_rows,))
            rows = first_row[seqs]
            part = self._decode_group(
                padded_q[rows], pages, kv_lens[seqs], table[seqs], sliding_window
            )
            return out.at[rows].set(part.astype(out.dtype))

        groups = (jnp.sum(single) + group_rows - 1) // group_rows
        out = lax.fori_loop(0, groups, group, out)
        return out[:t]

    def _decode_group(
        self,
        q: jax.Array,
        pages: jax.Array,
        lens: jax.Array,
        table: jax.Array,
        window: int | None,
    ) -> jax.Array:
        """A group's rows, one query each at position lens - 1 (lens 0: not a row)."""
        layout = self.layout
        rows, heads, dim = q.shape
        kv, groups = layout.kv_heads, heads // layout.kv_heads
        per, size = self.decode_pages, layout.page_size
        block = per * size
        position = lens - 1
        qg = q.reshape(rows, kv, groups, dim).astype(F32)
        flat = pages.reshape(layout.num_pages * size, kv, 2, layout.shape[-1])
        stop = (jnp.max(lens) + block - 1) // block
        first = jnp.zeros((), jnp.int32)
        if window is not None:
            lowest = jnp.where(lens > 0, position - window + 1, jnp.iinfo(jnp.int32).max)
            first = jnp.minimum(jnp.maximum(jnp.min(lowest), 0) // block, stop)

        def body(j: jax.Array, carry: Carry) -> Carry:
            ids = lax.dynamic_slice(table, (0, j * per), (rows, per))
            slots = (ids[:, :, None] * size + jnp.arange(size, dtype=jnp.int32)).reshape(
                rows, block
            )
            # (rows, block, kv, dim), in float32 as the scores are (8-bit pages: decoded)
            keys, values = layout.decode(flat[slots, :, 0]), layout.decode(flat[slots, :, 1])
            scores = jnp.einsum("rkgd,rlkd->rkgl", qg, keys, preferred_element_type=F32)
            scores = scores * (dim**-0.5)
            k_pos = j * block + jnp.arange(block, dtype=jnp.int32)[None, :]
            seen = k_pos <= position[:, None]
            if window is not None:
                seen = seen & (k_pos > position[:, None] - window)
            (top, total, acc), probs = online_update(carry, scores, seen[:, None, None, :])
            pv = jnp.einsum("rkgl,rlkd->rkgd", probs, values, preferred_element_type=F32)
            return top, total, acc + pv

        init = (
            jnp.full((rows, kv, groups), NEG_INF, F32),
            jnp.zeros((rows, kv, groups), F32),
            jnp.zeros((rows, kv, groups, dim), F32),
        )
        _, total, acc = lax.fori_loop(first, stop, body, init)
        return finish(total, acc).reshape(rows, heads, dim)

    def _query_tile(
        self,
        q: jax.Array,
        pages: jax.Array,
        n: jax.Array,
        first_pos: jax.Array,
        table: jax.Array,
        window: int | None,
    ) -> jax.Array:
        """A tile's rows of one sequence at positions first_pos + r; rows r >= n are
        not its own (zeros)."""
        layout = self.layout
        rows, heads, dim = q.shape
        kv, groups = layout.kv_heads, heads // layout.kv_heads
        per, size = self.tile_pages, layout.page_size
        block = per * size
        qg = q.reshape(rows, kv, groups, dim).astype(F32)
        flat = pages.reshape(layout.num_pages * size, kv, 2, layout.shape[-1])
        stop = jnp.where(n > 0, (first_pos + n - 1) // block + 1, 0)
        first = jnp.zeros((), jnp.int32)
        if window is not None:
            first = jnp.minimum(jnp.maximum(first_pos - window + 1, 0) // block, stop)

        def body(j: jax.Array, carry: Carry) -> Carry:
            ids = lax.dynamic_slice(table, (j * per,), (per,))
            slots = (ids[:, None] * size + jnp.arange(size, dtype=jnp.int32)).reshape(block)
            keys, values = layout.decode(flat[slots, :, 0]), layout.decode(flat[slots, :, 1])
            scores = jnp.einsum("qkgd,lkd->kgql", qg, keys, preferred_element_type=F32)
            scores = scores * (dim**-0.5)
            r = jnp.arange(rows, dtype=jnp.int32)[:, None]
            position = first_pos + r
            k_pos = j * block + jnp.arange(block, dtype=jnp.int32)[None, :]
            seen = (k_pos <= position) & (r < n)
            if window is not None:
                seen = seen & (k_pos > position - window)
            (top, total, acc), probs = online_update(carry, scores, seen[None, None])
            pv = jnp.einsum("kgql,lkd->kgqd", probs, values, preferred_element_type=F32)
            return top, total, acc + pv

        init = (
            jnp.full((kv, groups, rows), NEG_INF, F32),
            jnp.zeros((kv, groups, rows), F32),
            jnp.zeros((kv, groups, rows, dim), F32),
        )
        _, total, acc = lax.fori_loop(first, stop, body, init)
        return finish(total, acc).transpose(2, 0, 1, 3).reshape(rows, heads, dim)
