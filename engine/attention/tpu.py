"""TPU attention: jax's Pallas ragged paged attention kernel over the paged cache.

Owns: calling `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (the kernel
maintained in the jax release we pin; tokamax's wheel on the package index carries
no ragged paged attention yet) with block sizes and a VMEM limit of our choosing,
once per device under `shard_map` (XLA cannot partition a custom call: each device
runs the kernel on its own kv heads and the query heads that read them), and head
folding for head_dim < 128 (engine.attention.layout: the kernel asserts whole
128-lane rows; a query of folded kv head j of a row is zero outside its lanes, so
its scores and output are its own head's).

Block sizes are fixed here rather than taken from the kernel's tuned table, which
looks up the default device and so cannot serve ahead-of-time compilation.
KV_BLOCK_TOKENS bounds what one fetch overshoots: the kernel copies whole blocks of
pages, so a sequence reads up to one block past its length
(bench/tpu_aot.py counts those pages).

8-bit KV (engine.attention.kv_dtype): fp8 pages go to the kernel as they are, with
k_scale = v_scale = 1.0 (static floats, the only scales it takes); int8 pages, whose
rows carry their own scales, are refused here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import Mesh, PartitionSpec

from engine.attention.layout import AttentionBatch, KVLayout

KV_BLOCK_TOKENS = 512  # positions per fetched block of pages
QUERIES_PER_BLOCK = 128  # a prompt chunk reads its KV once per block of queries
VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # of v5e's and v6e's 128 MiB; the default 16 MiB is short
MODEL_AXIS = "model"


def kv_pages_per_block(layout: KVLayout, pages_per_seq: int) -> int:
    return max(1, min(pages_per_seq, KV_BLOCK_TOKENS // layout.page_size))


def queries_per_block(tokens: int) -> int:
    return min(QUERIES_PER_BLOCK, tokens)


def fold_queries(q: jax.Array, kv_heads: int, fold: int) -> jax.Array:
    """(T, heads, d) -> (T, heads, d * fold): query head of kv head c * fold + j at lanes
    j * d of its row, zeros elsewhere (head order unchanged)."""
    if fold == 1:
        return q
    t, heads, d = q.shape
    groups = heads // kv_heads
    q = q.reshape(t, kv_heads // fold, fold, groups, d)
    parts = [
        jnp.pad(q[:, :, j], ((0, 0), (0, 0), (0, 0), (j * d, (fold - 1 - j) * d)))
        for j in range(fold)
    ]
    return jnp.stack(parts, axis=2).reshape(t, heads, d * fold)


def unfold_outputs(out: jax.Array, kv_heads: int, fold: int) -> jax.Array:
    """fold_queries' inverse on the kernel's output: each head's own lanes."""
    if fold == 1:
        return out
    t, heads, lanes = out.shape
    d = lanes // fold
    out = out.reshape(t, kv_heads // fold, fold, heads // kv_heads, lanes)
    parts = [out[:, :, j, :, j * d : (j + 1) * d] for j in range(fold)]
    return jnp.stack(parts, axis=2).reshape(t, heads, d)


class PallasAttention:
    """The kernel per device of `mesh` (None: one device, no shard_map).

    `kernel` stands in for the Pallas kernel in tests on CPU: Pallas' interpret modes
    in jax 0.10.2 cannot run this kernel (its reshaped and strided VMEM reads), so
    there the kernel's own reference checks the folding and sharding around it.
    """

    def __init__(
        self,
        layout: KVLayout,
        mesh: Mesh | None = None,
        kernel: Callable[..., jax.Array] | None = None,
    ) -> None:
        if layout.scale_lanes:
            raise ValueError(
                f"kv_cache_dtype int8 is not supported on TPU: its pages keep a scale per "
                f"row, and jax's ragged paged attention kernel takes one static k_scale / "
                f"v_scale (use --kv-cache-dtype fp8); got pages of {layout.dtype}"
            )
        self.layout = layout
        self.kernel = kernel or ragged_paged_attention
        self.mesh = mesh
        self.shards = 1 if mesh is None else mesh.devices.size
        if layout.kv_heads % (self.shards * layout.fold):
            raise ValueError(
                f"kv_heads {layout.kv_heads} must split into {self.shards} devices of "
                f"whole folds of {layout.fold}"
            )

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

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        shards = self.shards
        local = KVLayout(
            self.layout.num_pages,
            self.layout.page_size,
            self.layout.kv_heads // shards,
            self.layout.head_dim,
            self.layout.dtype,
            self.layout.fold,
        )
        heads = PartitionSpec(None, MODEL_AXIS, None)
        fn = self._per_device(
            local.write,
            (PartitionSpec(None, None, MODEL_AXIS, None), heads, heads, PartitionSpec()),
            PartitionSpec(None, None, MODEL_AXIS, None),
        )
        return fn(pages, k, v, slots)

    def attend(
        self,
        q: jax.Array,
        pages: jax.Array,
        batch: AttentionBatch,
        *,
        sliding_window: int | None = None,
    ) -> jax.Array:
        layout = self.layout
        # fp8 pages (scale 1): the kernel converts each block it reads to q's dtype
        scales = {"k_scale": 1.0, "v_scale": 1.0} if layout.quantized else {}
        kernel = functools.partial(
            self.kernel,
            sm_scale=layout.head_dim**-0.5,
            sliding_window=sliding_window,
            num_kv_pages_per_block=kv_pages_per_block(layout, batch.page_indices.shape[1]),
            num_queries_per_block=queries_per_block(q.shape[0]),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
            **scales,
        )
        kv_local = layout.kv_heads // self.shards

        def local(
            q: jax.Array,
            pages: jax.Array,
            kv_lens: jax.Array,
            page_indices: jax.Array,
            cu_q_lens: jax.Array,
            num_seqs: jax.Array,
        ) -> jax.Array:
            folded = fold_queries(q, kv_local, layout.fold)
            out = kernel(folded, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
            return unfold_outputs(out, kv_local, layout.fold)

        whole = PartitionSpec()
        heads = PartitionSpec(None, MODEL_AXIS, None)
        fn = self._per_device(
            local,
            (heads, PartitionSpec(None, None, MODEL_AXIS, None), whole, whole, whole, whole),
            heads,
        )
        return fn(q, pages, batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
