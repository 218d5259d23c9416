"""CPU attention that reads each query's pages where they lie
(engine/attention/cpu_queries.cc), for decode rows and prompt chunks alike.

Owns: `query_attention`, the call, and `usable`, whether a layout and head shape can
take it. Receives a step's queries (R, heads, head_dim) float32, each row's length (its
query at position len - 1; 0: no row) and sequence (its row of the page table), the
page table, and every layer's float32 or bfloat16 pages as the engine keeps them (`KVLayout`, fold
1, interleaved keys and values); emits (R, heads, head_dim) float32, zeros for rows of
length 0.

Why: XLA:CPU's forms (engine.attention.cpu's decode groups and query tiles) gather a
block's positions into fresh key and value blocks and run their loops at a few GB/s and
GFLOP/s here (bench/README, "CPU decode attention", "Prompt attention in the kernel");
the kernel reads K and V once, in place, and a prompt chunk's rows share each row of K
and V they read. A query is computed alone in one fixed order (the .cc file says how),
so its bits are its own in any batch, and a prompt position has the bits it would have
as a decode row: how a prompt is chunked, or how much of it a prefix hit skips, changes
no bit.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from engine import row_dot
from engine.attention.layout import KVLayout

SOURCE = Path(__file__).with_name("cpu_queries.cc")
TARGET = "jax_llm_server_query_attention_f32"
BF16_TARGET = "jax_llm_server_query_attention_bf16"  # bfloat16 pages, widened as read
BITS_TARGET = "jax_llm_server_query_attention_u16"  # the same, kept as bits (KVLayout.bits)
MAX_GROUPS = 16  # query heads per kv head the kernel takes
MAX_HEAD_DIM = 256


def usable(layout: KVLayout, heads: int) -> bool:
    """Whether the kernel takes this layout and head shape, and is built here: float32
    or bfloat16 pages, fold 1, token-major, head_dim a multiple of 8 up to 256."""
    fits = (
        layout.dtype in ("float32", "bfloat16")
        and layout.fold == 1
        and not layout.head_major
        and layout.scale_lanes == 0
        and layout.head_dim % 8 == 0
        and layout.head_dim <= MAX_HEAD_DIM
        and heads % layout.kv_heads == 0
        and heads // layout.kv_heads <= MAX_GROUPS
    )
    targets = {TARGET: "QueryAttentionF32", BF16_TARGET: "QueryAttentionBf16"}
    targets[BITS_TARGET] = "QueryAttentionU16"
    return fits and row_dot.load(SOURCE, targets)


def query_attention(
    q: jax.Array,
    lens: jax.Array,
    seqs: jax.Array,
    table: jax.Array,
    pages: jax.Array,
    window: int | None,
) -> jax.Array:
    """q (R, heads, dim) float32, lens (R,) int32, seqs (R,) int32, table (S, P) int32,
    pages (N, size, 2 * kv, dim) float32, bfloat16, or bfloat16's bits as uint16 -> (R,
    heads, dim) float32; `usable` first.
    `window`: a sliding window's width, or None."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    width = jnp.asarray([window or 0], jnp.int32)
    i32 = jnp.int32
    target = {jnp.bfloat16: BF16_TARGET, jnp.uint16: BITS_TARGET}.get(pages.dtype.type, TARGET)
    return jax.ffi.ffi_call(target, out)(
        q.astype(jnp.float32), lens.astype(i32), seqs.astype(i32), table.astype(i32), pages, width
    )
