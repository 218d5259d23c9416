"""The Pallas kernel of the GPU backend: blocks of queries over one kv head's pages.

Owns: `block_attention`, one `pallas_call` over a grid of (query block, kv head). Receives
query blocks already gathered (NB, kv_heads, rows, head_dim), head-major pages
(engine.attention.layout: row 2h of the page array is kv head h's keys, 2h + 1 its
values), a page table per block (NB, table_pages) and per block three numbers
(`meta`: its sequence's positions, the position of its first query, its real queries);
emits (NB, kv_heads, rows, head_dim) in the queries' dtype. engine.attention.gpu cuts a
ragged batch into such blocks and puts the rows back.

A block's row r is query r // groups of the block and query head r % groups of the kv
head (`groups` a power of two, the model's query heads per kv head padded up). Its
program loops over the pages its queries may see, PAGES_PER_BLOCK pages an iteration
(from the first page in the window to the page of its last query), with an online
softmax in float32: the keys of one iteration are gathered straight from the pages the
table names (no copy of the cache, no transpose), masked by position (causal, window,
real queries), and the probabilities multiply the values in the pages' dtype cast to the
queries' (scores and sums in float32, as engine.attention.reference).

Written for Pallas' Triton lowering (`compiler_params`: warps and pipeline stages);
`interpret=True` runs the same program on any backend (the CPU suite checks it against
the reference, tests/engine/test_attention_gpu.py). The shapes Triton loads are powers
of two: rows (>= 16, its smallest product), head_dim, PAGES_PER_BLOCK * page_size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
# A score no key may take: finite, so a block all masked gives exp(0) rather than NaN
# (those rows are either overwritten by the first key seen or zeroed at the end).
MASKED = -0.7 * float(jnp.finfo(F32).max)
META_FIELDS = 4  # kv_len, first query's position, real queries, unused (a power of two)
MIN_ROWS = 16  # Triton's smallest product dimension


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(
    table_ref: jax.Array,  # (table_pages,) int32: the block's sequence's pages
    meta_ref: jax.Array,  # (META_FIELDS,) int32
    q_ref: jax.Array,  # (rows, head_dim)
    k_ref: jax.Array,  # (num_pages, page_size, head_dim): this kv head's keys
    v_ref: jax.Array,  # (num_pages, page_size, head_dim): its values
    *out_refs: jax.Array,  # (rows, head_dim); split: unnormalized, and (rows,) max and sum
    groups: int,
    real_groups: int,
    pages_per_block: int,
    scale: float,
    window: int | None,
    precision: lax.Precision,
    splits: int,
) -> None:
    rows, dim = q_ref.shape
    page_size = k_ref.shape[1]
    block = pages_per_block * page_size
    kv_len, first_pos, count = meta_ref[0], meta_ref[1], meta_ref[2]
    q = q_ref[...]
    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    query = row // groups
    real = (query < count) & (row % groups < real_groups)
    position = first_pos + query
    # the pages up to the block's last query (none for a block with no queries)
    last = jnp.minimum(first_pos + count, kv_len)
    stop = jnp.where(count > 0, (last + block - 1) // block, 0)
    start = jnp.zeros((), jnp.int32)
    if window is not None:
        start = jnp.minimum(jnp.maximum(first_pos - window + 1, 0) // block, stop)
    if splits > 1:  # this program's share of the iterations (none past the end)
        share = (stop - start + splits - 1) // splits
        start = start + pl.program_id(2) * share
        stop = jnp.minimum(start + share, stop)

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple:
        top, total, acc = carry
        ids = table_ref[pl.ds(j * pages_per_block, pages_per_block)]
        keys = k_ref[ids].reshape(block, dim).astype(q.dtype)
        values = v_ref[ids].reshape(block, dim).astype(q.dtype)
        scores = jnp.dot(q, keys.T, preferred_element_type=F32, precision=precision) * scale
        k_pos = j * block + lax.broadcasted_iota(jnp.int32, (rows, block), 1)
        seen = k_pos <= position[:, None]
        if window is not None:
            seen = seen & (k_pos > position[:, None] - window)
        scores = jnp.where(seen, scores, MASKED)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        correction = jnp.exp(top - new_top)
        probs = jnp.exp(scores - new_top[:, None])
        total = total * correction + jnp.sum(probs, axis=1)
        pv = jnp.dot(probs.astype(q.dtype), values, preferred_element_type=F32, precision=precision)
        return new_top, total, acc * correction[:, None] + pv

    init = (
        jnp.full((rows,), MASKED, F32),
        jnp.zeros((rows,), F32),
        jnp.zeros((rows, dim), F32),
    )
    top, total, acc = lax.fori_loop(start, stop, body, init)
    if splits > 1:  # combined by `combine_splits`
        o_ref, top_ref, total_ref = out_refs
        o_ref[...] = acc
        top_ref[...] = top
        total_ref[...] = total
        return
    (o_ref,) = out_refs
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    o_ref[...] = jnp.where(real[:, None], out, 0.0).astype(o_ref.dtype)


def combine_splits(acc: jax.Array, top: jax.Array, total: jax.Array) -> jax.Array:
    """Split programs' unnormalized outputs (..., splits, rows, d), maxima and sums
    (..., splits, rows) -> the normalized output (..., rows, d), float32. A split that
    saw no key has the MASKED maximum: its weight is 0 beside one that did."""
    best = jnp.max(top, axis=-2, keepdims=True)
    weight = jnp.exp(top - best)
    out = jnp.sum(acc * weight[..., None], axis=-3)
    total = jnp.sum(total * weight, axis=-2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "real_groups",
        "groups",
        "pages_per_block",
        "window",
        "interpret",
        "num_warps",
        "num_stages",
        "splits",
    ),
)
def block_attention(
    q: jax.Array,
    pages: jax.Array,
    tables: jax.Array,
    meta: jax.Array,
    *,
    real_groups: int,
    groups: int,
    pages_per_block: int,
    window: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
    splits: int = 1,
) -> jax.Array:
    """Query blocks q (NB, kv_heads, rows, d) over head-major pages (2 * kv_heads,
    num_pages, page_size, d); tables (NB, table_pages) with table_pages a multiple of
    pages_per_block; meta (NB, META_FIELDS). Returns (NB, kv_heads, rows, d).

    `splits` > 1 divides each block's pages among that many programs (more programs for
    few blocks: a decode row alone would keep kv_heads of the GPU's cores busy), their
    partial results combined after the call (float32 rows: the reads a split adds)."""
    blocks, kv_heads, rows, dim = q.shape
    _, num_pages, page_size, lanes = pages.shape
    if lanes != dim:
        raise ValueError(f"pages of {lanes} lanes for head_dim {dim} (8-bit rows with scales?)")
    if tables.shape[1] % pages_per_block:
        raise ValueError(f"table of {tables.shape[1]} pages, blocks of {pages_per_block}")
    kernel = functools.partial(
        _kernel,
        groups=groups,
        real_groups=real_groups,
        pages_per_block=pages_per_block,
        scale=dim**-0.5,
        window=window,
        # float32 queries: exact float32 products (Triton's default would be TF32)
        precision=lax.Precision.HIGHEST if q.dtype == F32 else lax.Precision.DEFAULT,
        splits=splits,
    )
    page_spec = functools.partial(pl.BlockSpec, (None, num_pages, page_size, dim))
    in_specs = [
        pl.BlockSpec((None, tables.shape[1]), lambda b, h, i: (b, 0)),
        pl.BlockSpec((None, META_FIELDS), lambda b, h, i: (b, 0)),
        pl.BlockSpec((None, None, rows, dim), lambda b, h, i: (b, h, 0, 0)),
        page_spec(lambda b, h, i: (2 * h, 0, 0, 0)),  # keys of kv head h
        page_spec(lambda b, h, i: (2 * h + 1, 0, 0, 0)),  # its values
    ]
    if splits == 1:
        out_specs: list[pl.BlockSpec] = [
            pl.BlockSpec((None, None, rows, dim), lambda b, h, i: (b, h, 0, 0))
        ]
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, i: (b, h, i, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i: (b, h, i, 0)),
        ]
        split = (blocks, kv_heads, splits, rows)
        out_shape = [
            jax.ShapeDtypeStruct((*split, dim), F32),
            jax.ShapeDtypeStruct(split, F32),
            jax.ShapeDtypeStruct(split, F32),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(blocks, kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_block_attention",
    )(tables, meta, q, pages, pages)
    if splits == 1:
        return outs[0]
    return combine_splits(*outs).astype(q.dtype)
