"""GPU attention over head-major pages: a Pallas kernel, or the same math in XLA.

Owns: `GpuAttention`, the GPU backend of the `Attention` seam, over head-major pages
(engine.attention.layout; engine.attention.attention_layout chooses them). Receives a
ragged batch's queries (T, heads, head_dim), the layer's pages with this step's K/V
written, and the `AttentionBatch`; emits (T, heads, head_dim) matching
engine.attention.reference (scores and softmax in float32; padding queries give zeros).

Two forms, `kernel`:
- "pallas" (the default): engine.attention.gpu_kernel in two calls a layer. Decode rows
  (sequences of one query, wherever they stand) each make one block of their kv head's
  query heads, so a row reads only its own pages once per kv head (in a bucket of few
  sequences, its pages split among up to MAX_SPLITS programs); prompt chunks make
  blocks of CHUNK_QUERIES queries, each reading the pages up to its last query. A call's
  block count is fixed by the bucket (T, S), so the step program has one shape; blocks
  with no queries return at once.
- "xla": the reference's gather-mask-softmax, over head-major pages: each kv head's
  keys gathered as (T, positions, head_dim) with no transpose (the issue's measurement:
  0.61 against the reference's 0.89 ms at 8B x 64); bench.gpu_decode compares the two.

`interpret=True` runs the Pallas kernel through Pallas' interpreter (CPU tests).
Tensor parallel: each device runs either form on its own kv heads (shard_map), as the
TPU backend does. KV dtypes: the model's, and fp8 (scale 1, read and cast in the
kernel); int8 pages (a scale in each row's last lanes) are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from engine.attention import gpu_kernel
from engine.attention.gpu_kernel import META_FIELDS, MIN_ROWS, next_power_of_two
from engine.attention.layout import AttentionBatch, KVLayout, pages_for
from engine.attention.reference import causal_probs, query_positions

F32 = jnp.float32
KERNELS = ("pallas", "xla")
CHUNK_QUERIES = 16  # a prompt chunk's queries per block (rows: x the padded groups)
KV_BLOCK_TOKENS = 64  # positions a program reads an iteration (whole pages)
# Decode rows' pages are split among programs until there are about this many: a batch of
# one row on 8 kv heads would otherwise run 8 programs on a GPU of 132 cores (H100/H200).
TARGET_PROGRAMS = 256
MAX_SPLITS = 8
MODEL_AXIS = "model"
HEADS_SPEC = PartitionSpec(None, MODEL_AXIS, None)  # (T, heads, d) split by head
PAGES_SPEC = PartitionSpec(MODEL_AXIS, None, None, None)  # head-major pages, by kv head


class GpuAttention:
    """Paged attention over head-major pages, per device of `mesh` (None: one device)."""

    def __init__(
        self,
        layout: KVLayout,
        mesh: Mesh | None = None,
        *,
        kernel: str = "pallas",
        interpret: bool = False,
        chunk_queries: int = CHUNK_QUERIES,
        kv_block_tokens: int = KV_BLOCK_TOKENS,
        max_splits: int = MAX_SPLITS,
    ) -> None:
        if not layout.head_major:
            raise ValueError("GpuAttention reads head-major pages (attention_layout)")
        if layout.scale_lanes:
            raise ValueError(
                f"kv_cache_dtype int8 is not supported on GPU: its rows keep their scales in "
                f"extra lanes the kernel does not read (use --kv-cache-dtype fp8); got pages "
                f"of {layout.dtype}"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
        self.layout = layout
        self.mesh = mesh
        self.kernel = kernel
        self.interpret = interpret
        self.chunk_queries = next_power_of_two(chunk_queries)
        self.pages_per_block = next_power_of_two(max(1, kv_block_tokens // layout.page_size))
        self.max_splits = max(1, max_splits)
        self.shards = 1 if mesh is None else mesh.devices.size
        if layout.kv_heads % self.shards:
            raise ValueError(f"kv_heads {layout.kv_heads} must split into {self.shards} devices")

    def _per_device(
        self,
        fn: Callable[..., jax.Array],
        in_specs: tuple[PartitionSpec, ...],
        out_specs: PartitionSpec,
    ) -> Callable[..., jax.Array]:
        if self.mesh is None or self.shards == 1:
            return fn
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def any_form_bits(self, heads: int) -> bool:
        return False  # a chunk's queries share blocks in the kernel

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        local = replace(self.layout, kv_heads=self.layout.kv_heads // self.shards)
        specs = (PAGES_SPEC, HEADS_SPEC, HEADS_SPEC, PartitionSpec())
        return self._per_device(local.write, specs, PAGES_SPEC)(pages, k, v, slots)

    def attend(
        self,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        sliding_window: int | None = None,
    ) -> jax.Array:
        local = replace(self.layout, kv_heads=self.layout.kv_heads // self.shards)
        form = self._pallas if self.kernel == "pallas" else self._xla
        fn = functools.partial(form, local, window=sliding_window)

        def run(
            q: jax.Array,
            pages: jax.Array,
            kv_lens: jax.Array,
            page_indices: jax.Array,
            cu_q_lens: jax.Array,
            num_seqs: jax.Array,
        ) -> jax.Array:
            return fn(q, pages, AttentionBatch(kv_lens, page_indices, cu_q_lens, num_seqs))

        whole = PartitionSpec()
        specs = (HEADS_SPEC, PAGES_SPEC, whole, whole, whole, whole)
        return self._per_device(run, specs, HEADS_SPEC)(
            q,
            pages,
            *(jnp.asarray(a, jnp.int32) for a in (batch.kv_lens, batch.page_indices)),
            *(jnp.asarray(a, jnp.int32) for a in (batch.cu_q_lens, batch.num_seqs)),
        )

    def _xla(
        self,
        layout: KVLayout,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        window: int | None,
    ) -> jax.Array:
        t, heads, dim = q.shape
        groups = heads // layout.kv_heads
        seq, position, real = query_positions(t, batch)
        table = batch.page_indices[seq]  # (T, pages_per_seq)
        # (kv_heads, T, positions, d): each head's pages gathered in place, no transpose
        keys = pages[0::2][:, table].reshape(layout.kv_heads, t, -1, pages.shape[-1])
        values = pages[1::2][:, table].reshape(layout.kv_heads, t, -1, pages.shape[-1])
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        qg = q.reshape(t, layout.kv_heads, groups, dim)
        scores = jnp.einsum("tkgd,ktld->tkgl", qg, keys, preferred_element_type=F32)
        scores = scores * (dim**-0.5)
        probs = causal_probs(scores, position, real, window).astype(q.dtype)  # the reference's
        out = jnp.einsum("tkgl,ktld->tkgd", probs, values, preferred_element_type=F32)
        return out.astype(q.dtype).reshape(t, heads, dim)

    def _pallas(
        self,
        layout: KVLayout,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        window: int | None,
    ) -> jax.Array:
        t, heads, dim = q.shape
        s = batch.kv_lens.shape[0]
        kv = layout.kv_heads
        real_groups = heads // kv
        groups = next_power_of_two(real_groups)
        per = self.pages_per_block
        width = pages_for(batch.page_indices.shape[1], per) * per
        table = jnp.pad(batch.page_indices, ((0, 0), (0, width - batch.page_indices.shape[1])))
        cu, kv_lens = jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.kv_lens)
        q_lens = cu[1:] - cu[:-1]
        real = jnp.arange(s) < batch.num_seqs[0]
        single = real & (q_lens == 1)
        chunked = real & (q_lens > 1)
        call = functools.partial(
            gpu_kernel.block_attention,
            real_groups=real_groups,
            groups=groups,
            pages_per_block=per,
            window=window,
            interpret=self.interpret,
        )
        padded_q = jnp.pad(q, ((0, self.chunk_queries), (0, 0), (0, 0)))

        # decode rows: a block per sequence (its one query at position kv_len - 1)
        meta = jnp.stack(
            [kv_lens, kv_lens - 1, single.astype(jnp.int32), jnp.zeros_like(kv_lens)], axis=1
        )
        blocks = gather_queries(padded_q, cu[:-1], 1, kv, groups)
        splits = max(1, min(self.max_splits, TARGET_PROGRAMS // (s * kv)))
        decode = call(blocks, pages, table, meta, splits=splits)  # (S, kv, rows, d)

        # prompt chunks: blocks of chunk_queries queries, in order
        per_q = self.chunk_queries
        count = t // per_q + min(s, max(1, t // 2))  # any batch's chunk blocks fit
        tiles = jnp.where(chunked, (q_lens + per_q - 1) // per_q, 0)
        ends = jnp.cumsum(tiles)
        u = jnp.arange(count, dtype=jnp.int32)
        owner = jnp.minimum(jnp.searchsorted(ends, u, side="right"), s - 1).astype(jnp.int32)
        i = u - (ends[owner] - tiles[owner])
        n = jnp.where(u < ends[-1], jnp.minimum(q_lens[owner] - i * per_q, per_q), 0)
        first_pos = kv_lens[owner] - q_lens[owner] + i * per_q
        meta = jnp.stack([kv_lens[owner], first_pos, n, jnp.zeros_like(n)], axis=1)
        blocks = gather_queries(padded_q, cu[owner] + i * per_q, per_q, kv, groups)
        chunks = call(blocks, pages, table[owner], meta)  # (count, kv, rows, d)

        # each query's rows back from its block
        seq, _, real_token = query_positions(t, batch)
        offset = jnp.arange(t, dtype=jnp.int32) - cu[seq]
        tile = jnp.minimum(ends[seq] - tiles[seq] + offset // per_q, count - 1)
        from_chunk = rows_of(chunks, tile, offset % per_q, per_q, groups)
        from_decode = rows_of(decode, seq, jnp.zeros_like(seq), 1, groups)
        out = jnp.where(single[seq][:, None, None, None], from_decode, from_chunk)
        out = jnp.where(real_token[:, None, None, None], out, 0)
        return out[:, :, :real_groups].reshape(t, heads, dim).astype(q.dtype)


def rows_per_block(queries: int, groups: int) -> int:
    return max(MIN_ROWS, queries * groups)


def gather_queries(q: jax.Array, first: jax.Array, queries: int, kv: int, groups: int) -> jax.Array:
    """Blocks of `queries` queries from each `first` (B,): (B, kv, rows, d), row r holding
    query r // groups, head r % groups of its kv head (zeros for padded heads and rows)."""
    _, heads, dim = q.shape
    take = q[first[:, None] + jnp.arange(queries, dtype=jnp.int32)]  # (B, queries, heads, d)
    take = take.reshape(first.shape[0], queries, kv, heads // kv, dim)
    take = jnp.pad(take, ((0, 0), (0, 0), (0, 0), (0, groups - heads // kv), (0, 0)))
    take = take.transpose(0, 2, 1, 3, 4).reshape(first.shape[0], kv, queries * groups, dim)
    extra = rows_per_block(queries, groups) - queries * groups
    return jnp.pad(take, ((0, 0), (0, 0), (0, extra), (0, 0)))


def rows_of(
    out: jax.Array, block: jax.Array, query: jax.Array, queries: int, groups: int
) -> jax.Array:
    """Per token, its query's rows of block `block`: (T, kv, groups, d)."""
    b, kv, _, dim = out.shape
    out = out[:, :, : queries * groups].reshape(b, kv, queries, groups, dim)
    return out[block, :, query]


__all__ = ["GpuAttention", "KERNELS", "META_FIELDS"]
