"""Attention over a paged KV cache, behind one seam with a backend per platform.

Owns: the KV page layout (`KVLayout`), the ragged batch description attention reads
(`AttentionBatch`), and the choice of backend (`attention_backend`). Receives queries
and new keys / values of a ragged batch (decode rows are sequences of one query,
prompt chunks sequences of many); emits each query's attention output and the pages
with the new K/V written in place.

Backends (each an `Attention`):
- engine.attention.reference: pure JAX; defines correctness; runs anywhere (CPU when the
  scheduler's chunk bounds are not given; any platform when chosen: "reference").
- engine.attention.cpu: XLA:CPU; decode groups and query tiles that read only their
  live pages, bit-identical per sequence whatever the batch (bench.attention_bench).
- engine.attention.tpu: jax's Pallas ragged paged attention kernel (TPU), decode rows in
  blocks of their own query, prompt chunks in a second call.
- engine.attention.gpu: head-major pages (`attention_layout`), a Pallas kernel (Triton)
  for decode rows and prompt chunks ("gpu-pallas", the GPU's default) or the same math
  in XLA ("gpu-xla").
"""

from __future__ import annotations

from dataclasses import replace

from jax.sharding import Mesh

from engine.attention.cpu import CpuAttention
from engine.attention.layout import AttentionBatch, Ints, KVLayout, pages_for
from engine.attention.reference import Attention, ReferenceAttention
from engine.types import ATTENTION_BACKENDS

__all__ = [
    "ATTENTION_BACKENDS",
    "Attention",
    "AttentionBatch",
    "CpuAttention",
    "Ints",
    "KVLayout",
    "ReferenceAttention",
    "attention_backend",
    "attention_layout",
    "pages_for",
]


# "auto": the platform's backend; "reference": the pure-JAX definition on any platform;
# "gpu-pallas" / "gpu-xla": GpuAttention's two forms (GPU only).
_GPU_KERNELS = {"auto": "pallas", "gpu-pallas": "pallas", "gpu-xla": "xla"}


def _check(platform: str, choice: str) -> None:
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {list(ATTENTION_BACKENDS)}, got {choice!r}"
        )
    if choice.startswith("gpu-") and platform != "gpu":
        raise ValueError(f"attention backend {choice!r} runs on GPU only, not {platform}")


def attention_layout(layout: KVLayout, platform: str, choice: str = "auto") -> KVLayout:
    """The page layout the chosen backend reads (GPU: head-major, engine.attention.gpu)."""
    _check(platform, choice)
    if platform == "gpu" and choice != "reference":
        return replace(layout, head_major=True, fold=1, bits=False)
    return layout


def attention_backend(
    platform: str,
    layout: KVLayout,
    mesh: Mesh | None = None,
    *,
    chunk_size: int | None = None,
    max_prefill_seqs: int | None = None,
    choice: str = "auto",
) -> Attention:
    """The attention backend for a platform ("tpu", "gpu", "cpu"), a page layout (from
    `attention_layout`) and a choice (ATTENTION_BACKENDS); on CPU, the scheduler's chunk
    bounds (chunk_size, max_prefill_seqs) select CpuAttention."""
    _check(platform, choice)
    if choice == "reference":
        return ReferenceAttention(layout)
    if platform == "gpu":
        from engine.attention.gpu import GpuAttention  # imports Pallas only for GPU

        return GpuAttention(layout, mesh, kernel=_GPU_KERNELS[choice])
    if platform == "tpu":
        from engine.attention.tpu import PallasAttention  # imports Pallas only for TPU

        return PallasAttention(layout, mesh)
    if platform == "cpu" and chunk_size is not None and max_prefill_seqs is not None:
        # the decode kernel has no rule for splitting its operands: one device only
        alone = mesh is None or mesh.devices.size == 1
        return CpuAttention(
            layout, chunk_size=chunk_size, max_prefill_seqs=max_prefill_seqs, kernel=alone
        )
    return ReferenceAttention(layout)
