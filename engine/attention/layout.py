"""The paged KV cache's layout and the ragged batch description attention reads.

Owns: `KVLayout` (a layer's pages, `[num_pages, page_size, 2 * kv_heads / fold,
head_dim * fold]`, keys and values interleaved along the third axis, the layout of
jax's Pallas ragged paged attention kernel; the engine keeps every layer's in one such
array, `stacked`) and `AttentionBatch`.

`fold` puts that many adjacent kv heads side by side in one row of lanes. TPU tiles
the last axis in 128 lanes: a head_dim of 64 stored as is would take 128 lanes per
row in HBM, twice its bytes. Folded two to a row, a layer's KV takes exactly its
bytes; a query then reads its own head's lanes by being zero in the other's
(engine.attention.tpu). Every other backend keeps fold 1.

8-bit pages (`dtype` int8 or float8_*, engine.attention.kv_dtype) store each (token,
kv head) row encoded: `write` encodes, `unpack` and `decode` give float32; an int8 row
carries its scale in `scale_lanes` extra lanes after its values.

`bits` keeps 16- and 8-bit float pages in an unsigned integer array of the same width
(`array_dtype`), bitcast row by row as they are written and read (`view`): XLA:CPU
scatters into and gathers from a bfloat16 or fp8 array through a conversion of the whole
array, so a step there would cost in proportion to the whole cache (bench/README,
"Quantization"). The same bits are stored either way; CPU sets it (engine.core.core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.attention import kv_dtype


@dataclass(frozen=True)
class KVLayout:
    """One layer's KV pages: [num_pages, page_size, combined_heads, lanes]."""

    num_pages: int
    page_size: int
    kv_heads: int  # the model's kv heads on the mesh (with tensor-parallel replicas)
    head_dim: int
    dtype: str = "float32"  # the pages' (engine.attention.kv_dtype.storage_dtype)
    fold: int = 1  # adjacent kv heads side by side in one row of lanes
    bits: bool = False  # 16- and 8-bit float pages in an unsigned integer array (XLA:CPU)

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "kv_heads", "head_dim", "fold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_heads % self.fold:
            raise ValueError(f"fold {self.fold} must divide kv_heads {self.kv_heads}")

    @property
    def combined_heads(self) -> int:
        return 2 * self.kv_heads // self.fold

    @property
    def lanes(self) -> int:
        return self.head_dim * self.fold

    @property
    def scale_lanes(self) -> int:
        """Lanes of a row after its values holding its scale (int8 pages: 2)."""
        return kv_dtype.scale_lanes(self.dtype)

    @property
    def quantized(self) -> bool:
        return kv_dtype.is_quantized(self.dtype)

    @property
    def array_dtype(self) -> str:
        """The page array's dtype: `dtype`, or with `bits` an unsigned integer of its width
        where `dtype` is a 16- or 8-bit float."""
        kind = np.dtype(self.dtype)
        if self.bits and kind.kind not in "iu" and kind.itemsize < 4:
            return f"uint{8 * kind.itemsize}"
        return self.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.page_size, self.combined_heads, self.lanes + self.scale_lanes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (K and V)."""
        return math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one position's K and V in one layer."""
        return self.page_bytes // self.page_size

    def empty(self) -> jax.Array:
        return jnp.zeros(self.shape, self.array_dtype)

    def stacked(self, layers: int) -> KVLayout:
        """Every layer's pages in one array, layer l's page p at l * num_pages + p: what
        the engine's step scans its layers over (engine.paged_model.forward)."""
        return replace(self, num_pages=self.num_pages * layers)

    def view(self, rows: jax.Array) -> jax.Array:
        """Rows read from the page array, in `dtype` (with `bits`: bitcast back)."""
        if self.array_dtype == self.dtype:
            return rows
        return lax.bitcast_convert_type(rows, jnp.dtype(self.dtype))

    def pack(self, k: jax.Array, v: jax.Array) -> jax.Array:
        """New keys and values (T, kv_heads, head_dim) -> rows (T, combined_heads, lanes)."""
        t = k.shape[0]
        k = k.reshape(t, self.kv_heads // self.fold, self.lanes)
        v = v.reshape(t, self.kv_heads // self.fold, self.lanes)
        return jnp.stack([k, v], axis=2).reshape(t, self.combined_heads, self.lanes)

    def unpack(self, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Pages (..., combined_heads, lanes) -> keys and values (..., kv_heads, head_dim)
        (8-bit pages: decoded, float32)."""
        pages = self.decode(pages) if self.quantized else self.view(pages)
        lead = pages.shape[:-2]
        k = pages[..., 0::2, :].reshape(*lead, self.kv_heads, self.head_dim)
        v = pages[..., 1::2, :].reshape(*lead, self.kv_heads, self.head_dim)
        return k, v

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        """Pages with token i's K/V at flat slot slots[i] (page * page_size + offset), in
        place: one scatter. A slot past the last page (padding) writes nothing."""
        flat = pages.reshape(self.num_pages * self.page_size, self.combined_heads, self.shape[-1])
        rows = kv_dtype.encode(self.pack(k, v), self.dtype)
        if self.array_dtype != self.dtype:
            rows = lax.bitcast_convert_type(rows, jnp.dtype(self.array_dtype))
        return flat.at[slots].set(rows, mode="drop").reshape(pages.shape)

    def decode(self, rows: jax.Array) -> jax.Array:
        """Stored rows (..., lanes + scale_lanes) -> their values in float32 (..., lanes)."""
        return kv_dtype.decode(self.view(rows), self.dtype)


# A batch is built on the host (numpy) and read on the device (jax): either is fine.
Ints = jax.Array | np.ndarray


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionBatch:
    """A ragged batch as attention reads it (the Pallas kernel's arguments).

    Sequence s owns queries cu_q_lens[s]:cu_q_lens[s + 1] of the batch, the last ones
    of its kv_lens[s] positions (whose K/V the step has already written); its
    positions live in pages page_indices[s]. Only the first num_seqs[0] sequences are
    real; queries past cu_q_lens[num_seqs[0]] are padding and attend to nothing.
    """

    kv_lens: Ints  # (S,) int32
    page_indices: Ints  # (S, pages_per_seq) int32
    cu_q_lens: Ints  # (S + 1,) int32
    num_seqs: Ints  # (1,) int32
