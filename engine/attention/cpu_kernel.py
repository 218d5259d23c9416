"""CPU decode attention that reads each row's pages where they lie (engine/attention/cpu_decode.cc).

Owns: `decode_attention`, the call, and `usable`, whether a layout and head shape can
take it. Receives the decode rows' queries (R, heads, head_dim) float32, each row's
length (its query at position len - 1; 0: no row), its page table, and every layer's
float32 pages as the engine keeps them (`KVLayout`, fold 1, interleaved keys and
values); emits (R, heads, head_dim) float32, zeros for rows of length 0.

Why: XLA:CPU's form (engine.attention.cpu's decode groups) gathers every live position
of a group's rows into fresh key and value blocks each step and moved them at ~3.4 GB/s
here; at 32 sequences of ~400 positions the step spent about half its time there
(bench/README, "CPU decode attention"). The kernel reads K and V once, in place. A row
is computed alone in one fixed order (the .cc file says how), so its bits are its own
in any batch, as the decode groups' are; it differs from the prompt tiles' bits as they
do (one query: the decode form; engine.attention.cpu).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from engine import row_dot
from engine.attention.layout import KVLayout

SOURCE = Path(__file__).with_name("cpu_decode.cc")
TARGET = "jax_llm_server_decode_attention_f32"
MAX_GROUPS = 16  # query heads per kv head the kernel takes
MAX_HEAD_DIM = 256


def usable(layout: KVLayout, heads: int) -> bool:
    """Whether the kernel takes this layout and head shape, and is built here: float32
    pages, fold 1, token-major, head_dim a multiple of 8 up to 256."""
    fits = (
        layout.dtype == "float32"
        and layout.fold == 1
        and not layout.head_major
        and layout.scale_lanes == 0
        and layout.head_dim % 8 == 0
        and layout.head_dim <= MAX_HEAD_DIM
        and heads % layout.kv_heads == 0
        and heads // layout.kv_heads <= MAX_GROUPS
    )
    return fits and row_dot.load(SOURCE, {TARGET: "DecodeAttentionF32"})


def decode_attention(
    q: jax.Array, lens: jax.Array, table: jax.Array, pages: jax.Array, window: int | None
) -> jax.Array:
    """q (R, heads, dim) float32, lens (R,) int32, table (R, P) int32, pages (N, size,
    2 * kv, dim) float32 -> (R, heads, dim) float32; `usable` first. `window`: a sliding
    window's width, or None."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    width = jnp.asarray([window or 0], jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(
        q.astype(jnp.float32), lens.astype(jnp.int32), table.astype(jnp.int32), pages, width
    )
