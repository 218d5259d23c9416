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

Decode rows apart from prompt chunks: the kernel multiplies every query of a block
against the KV of each sequence in that block, so 64 decode rows in one block of 64
queries would do 64x their work. The scheduler puts decode rows (one query each) first;
`split_kernel` runs those leading rows through the kernel with blocks of one query (a
row meets its own KV only) and the sequences after them (prompt chunks, draft-verifying
rows) through a second call with blocks of QUERIES_PER_BLOCK, whose KV a chunk then reads
once per block. A decode row fetches its pages in blocks of DECODE_KV_BLOCK_TOKENS: at
contexts spread over 1..max it reads half what 512-position blocks overshoot, at one more
turn of the kernel's loop per 256 positions (bench/README.md, "TPU programs").
`kernel_calls` states the same rules for the counting in bench.tpu_aot.

8-bit KV (engine.attention.kv_dtype): fp8 pages go to the kernel as they are, with
k_scale = v_scale = 1.0 (static floats, the only scales it takes); int8 pages, whose
rows carry their own scales, are refused here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import Mesh, PartitionSpec

from engine.attention.layout import AttentionBatch, KVLayout

KV_BLOCK_TOKENS = 512  # positions per fetched block of pages
QUERIES_PER_BLOCK = 128  # a prompt chunk reads its KV once per block of queries
DECODE_QUERIES_PER_BLOCK = 1  # a decode row's block holds its own query only
DECODE_KV_BLOCK_TOKENS = 256  # positions per fetched block of a decode row's pages
VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # of v5e's and v6e's 128 MiB; the default 16 MiB is short
MODEL_AXIS = "model"


def kv_pages_per_block(layout: KVLayout, pages_per_seq: int, tokens: int = KV_BLOCK_TOKENS) -> int:
    return max(1, min(pages_per_seq, tokens // layout.page_size))


def queries_per_block(tokens: int) -> int:
    return min(QUERIES_PER_BLOCK, tokens)


def leading_decode_rows(q_lens: Sequence[int]) -> int:
    """How many sequences at the front of a batch are decode rows (one query each)."""
    rows = 0
    while rows < len(q_lens) and q_lens[rows] == 1:
        rows += 1
    return rows


@dataclass(frozen=True)
class KernelCall:
    """One call of the kernel as its block rules see it: its block sizes and, per
    sequence it computes, (first query in the batch, queries, kv_len)."""

    queries_per_block: int
    kv_pages_per_block: int
    sequences: tuple[tuple[int, int, int], ...]

    def blocks(self, page_size: int) -> list[tuple[int, int]]:
        """Per sequence: the query blocks that compute it and the KV blocks each reads.
        The kernel starts its first sequence at query block 0 (a call over the chunks
        after the decode rows computes the first chunk in every block up to its own)."""
        per_q, kv_block = self.queries_per_block, self.kv_pages_per_block * page_size
        out = []
        for i, (first, count, kv_len) in enumerate(self.sequences):
            start = 0 if i == 0 else first // per_q
            out.append(((first + count - 1) // per_q + 1 - start, -(-kv_len // kv_block)))
        return out


def kernel_calls(
    layout: KVLayout,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    tokens: int,
    pages_per_seq: int,
) -> tuple[KernelCall, ...]:
    """The kernel calls `split_kernel` makes for a batch (its real sequences)."""
    rows = leading_decode_rows(q_lens)
    firsts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    spans = tuple(zip(firsts, q_lens, kv_lens, strict=True))
    calls = []
    if rows or rows == len(q_lens):
        decode_block = kv_pages_per_block(layout, pages_per_seq, DECODE_KV_BLOCK_TOKENS)
        calls.append(KernelCall(DECODE_QUERIES_PER_BLOCK, decode_block, spans[:rows]))
    if rows < len(q_lens):
        block = kv_pages_per_block(layout, pages_per_seq)
        calls.append(KernelCall(queries_per_block(tokens), block, spans[rows:]))
    return tuple(calls)


def split_kernel(
    decode: Callable[..., jax.Array],
    chunks: Callable[..., jax.Array],
    q: jax.Array,
    pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> jax.Array:
    """The kernel over a ragged batch in two calls: `decode` over the leading decode rows,
    `chunks` over the sequences after them (their arrays shifted to start at index 0;
    their queries stay where they are). Each call's output is taken only at its own
    queries; a batch of one kind makes one call."""
    # host arrays (a batch outside jit) index as jax arrays, by the traced split
    kv_lens, page_indices, cu_q_lens, num_seqs = (
        jnp.asarray(a) for a in (kv_lens, page_indices, cu_q_lens, num_seqs)
    )
    seqs = kv_lens.shape[0]
    index = jnp.arange(seqs, dtype=jnp.int32)
    single = (cu_q_lens[1:] - cu_q_lens[:-1] == 1) & (index < num_seqs[0])
    rows = jnp.sum(jnp.cumprod(single.astype(jnp.int32)))
    rest = num_seqs[0] - rows

    def decode_only() -> jax.Array:
        return decode(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)

    def chunks_only() -> jax.Array:
        take = jnp.minimum(index + rows, seqs - 1)
        edges = jnp.minimum(jnp.arange(seqs + 1, dtype=jnp.int32) + rows, seqs)
        return chunks(q, pages, kv_lens[take], page_indices[take], cu_q_lens[edges], rest[None])

    def both() -> jax.Array:
        head = decode(q, pages, kv_lens, page_indices, cu_q_lens, rows[None])
        out = chunks_only()
        first = min(seqs, q.shape[0])  # the decode rows are among the first `seqs` queries
        token = jnp.arange(first, dtype=jnp.int32)
        mine = jnp.where((token < rows)[:, None, None], head[:first], out[:first])
        return out.at[:first].set(mine)

    branch = jnp.where(rest == 0, 0, jnp.where(rows == 0, 1, 2))
    return lax.switch(branch, (decode_only, chunks_only, both))


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

    def any_form_bits(self, heads: int) -> bool:
        return False  # a chunk's queries share blocks in the ragged kernel

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
        pages_per_seq = batch.page_indices.shape[1]
        common = functools.partial(
            self.kernel,
            sm_scale=layout.head_dim**-0.5,
            sliding_window=sliding_window,
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
            **scales,
        )
        decode = functools.partial(
            common,
            num_kv_pages_per_block=kv_pages_per_block(
                layout, pages_per_seq, DECODE_KV_BLOCK_TOKENS
            ),
            num_queries_per_block=DECODE_QUERIES_PER_BLOCK,
        )
        chunks = functools.partial(
            common,
            num_kv_pages_per_block=kv_pages_per_block(layout, pages_per_seq),
            num_queries_per_block=queries_per_block(q.shape[0]),
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
            out = split_kernel(
                decode, chunks, folded, pages, kv_lens, page_indices, cu_q_lens, num_seqs
            )
            return unfold_outputs(out, kv_local, layout.fold)

        whole = PartitionSpec()
        heads = PartitionSpec(None, MODEL_AXIS, None)
        fn = self._per_device(
            local,
            (heads, PartitionSpec(None, None, MODEL_AXIS, None), whole, whole, whole, whole),
            heads,
        )
        return fn(q, pages, batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
