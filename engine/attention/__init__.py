"""Attention over a paged KV cache, behind one seam with a backend per platform.

Owns: the KV page layout (`KVLayout`), the ragged batch description attention reads
(`AttentionBatch`), and the choice of backend (`attention_backend`). Receives queries
and new keys / values of a ragged batch (decode rows are sequences of one query,
prompt chunks sequences of many); emits each query's attention output and the pages
with the new K/V written in place.

Backends (each an `Attention`):
- engine.attention.reference: pure JAX; defines correctness; runs anywhere.
- engine.attention.tpu: jax's Pallas ragged paged attention kernel (TPU).
The CPU and GPU backends use the reference form until a measured faster one exists.
"""

from __future__ import annotations

from jax.sharding import Mesh

from engine.attention.layout import AttentionBatch, Ints, KVLayout, pages_for
from engine.attention.reference import Attention, ReferenceAttention

__all__ = [
    "Attention",
    "AttentionBatch",
    "Ints",
    "KVLayout",
    "ReferenceAttention",
    "attention_backend",
    "pages_for",
]


def attention_backend(platform: str, layout: KVLayout, mesh: Mesh | None = None) -> Attention:
    """The attention backend for a platform ("tpu", "gpu", "cpu") and page layout."""
    if platform == "tpu":
        from engine.attention.tpu import PallasAttention  # imports Pallas only for TPU

        return PallasAttention(layout, mesh)
    return ReferenceAttention(layout)
