"""Attention over a paged KV cache, behind one seam with a backend per platform.

Owns: the KV page layout (`KVLayout`), the ragged batch description attention reads
(`AttentionBatch`), and the choice of backend (`attention_backend`). Receives queries
and new keys / values of a ragged batch (decode rows are sequences of one query,
prompt chunks sequences of many); emits each query's attention output and the pages
with the new K/V written in place.

Backends (each an `Attention`):
- engine.attention.reference: pure JAX; defines correctness; runs anywhere (GPU today,
  and CPU when the scheduler's chunk bounds are not given).
- engine.attention.cpu: XLA:CPU; decode groups and query tiles that read only their
  live pages, bit-identical per sequence whatever the batch (bench.attention_bench).
- engine.attention.tpu: jax's Pallas ragged paged attention kernel (TPU), decode rows in
  blocks of their own query, prompt chunks in a second call.
"""

from __future__ import annotations

from jax.sharding import Mesh

from engine.attention.cpu import CpuAttention
from engine.attention.layout import AttentionBatch, Ints, KVLayout, pages_for
from engine.attention.reference import Attention, ReferenceAttention

__all__ = [
    "Attention",
    "AttentionBatch",
    "CpuAttention",
    "Ints",
    "KVLayout",
    "ReferenceAttention",
    "attention_backend",
    "pages_for",
]


def attention_backend(
    platform: str,
    layout: KVLayout,
    mesh: Mesh | None = None,
    *,
    chunk_size: int | None = None,
    max_prefill_seqs: int | None = None,
) -> Attention:
    """The attention backend for a platform ("tpu", "gpu", "cpu") and page layout; on
    CPU, the scheduler's chunk bounds (chunk_size, max_prefill_seqs) select CpuAttention."""
    if platform == "tpu":
        from engine.attention.tpu import PallasAttention  # imports Pallas only for TPU

        return PallasAttention(layout, mesh)
    if platform == "cpu" and chunk_size is not None and max_prefill_seqs is not None:
        return CpuAttention(layout, chunk_size=chunk_size, max_prefill_seqs=max_prefill_seqs)
    return ReferenceAttention(layout)
