"""The roofline of a TPU step: what a compiled program's work costs on a chip, and what
the step's unavoidable work would.

Owns: the chips' peaks (`CHIP_PEAKS`: bf16 FLOP/s and HBM bytes/s, public
specifications), `Work` (bytes and FLOPs of one step on one chip) with its roofline time
max(FLOPs / peak, bytes / bandwidth), what the Pallas attention kernel moves and
computes by its own block rules (XLA cannot see into it: `kernel_work`, over
engine.attention.tpu.kernel_calls), and the FLOPs a step must do (`useful_flops`:
every matmul weight once per token that passes it, the head per sampled row, and
causal attention over each query's own positions). Pure arithmetic; bench.tpu_aot
feeds it shapes and XLA's cost analysis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax

from engine.attention import KVLayout
from engine.attention.tpu import kernel_calls

# (bf16 FLOP/s, HBM bytes/s) per chip, by jax's device_kind.
CHIP_PEAKS = {
    "TPU v5 lite": (197e12, 819e9),
    "TPU v6 lite": (918e12, 1640e9),
}


@dataclass(frozen=True)
class Peaks:
    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def parse(cls, text: str) -> Peaks:
        """ "FLOPS,BYTES_PER_S" (e.g. "197e12,819e9")."""
        try:
            flops, bandwidth = (float(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"--chip-peaks takes FLOPS,BYTES_PER_S, got {text!r}") from None
        if flops <= 0 or bandwidth <= 0:
            raise ValueError(f"chip peaks must be positive, got {text!r}")
        return cls(flops, bandwidth)


@dataclass(frozen=True)
class Work:
    """One step's work on one chip."""

    bytes: float
    flops: float

    def __add__(self, other: Work) -> Work:
        return Work(self.bytes + other.bytes, self.flops + other.flops)

    def seconds(self, peaks: Peaks) -> float:
        return max(self.flops / peaks.flops_per_s, self.bytes / peaks.bytes_per_s)

    def bound(self, peaks: Peaks) -> str:
        hbm = self.bytes / peaks.bytes_per_s >= self.flops / peaks.flops_per_s
        return "hbm" if hbm else "flops"


def matmul_elements(tree: Any, min_axes: int = 2) -> int:
    """Elements on one chip of the arrays with `min_axes` or more axes (the matmul
    weights; 3 where a leading axis stacks the layers)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if len(leaf.shape) >= min_axes:
            total += math.prod(leaf.sharding.shard_shape(leaf.shape))
    return total


@dataclass(frozen=True)
class StepShape:
    """What one chip of a step computes: its model's sizes and its ragged batch."""

    layers: int
    heads: int  # query heads on the chip
    head_dim: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]  # each sequence's length after the step


def attention_flops(shape: StepShape) -> float:
    """Causal attention's products (QK and PV) over each query's own positions."""
    seen = 0
    for n, kv in zip(shape.q_lens, shape.kv_lens, strict=True):
        seen += n * (kv - n) + n * (n + 1) // 2
    return 4.0 * seen * shape.heads * shape.head_dim * shape.layers


def useful_flops(layer_weights: int, head_weights: int, shape: StepShape) -> float:
    """Every layer's weights once per token, the head once per sequence (its last
    token), and attention: the FLOPs the step must do on this chip."""
    tokens, seqs = sum(shape.q_lens), len(shape.q_lens)
    return 2.0 * (tokens * layer_weights + seqs * head_weights) + attention_flops(shape)


def kernel_work(
    layout: KVLayout,
    shape: StepShape,
    tokens: int,
    pages_per_seq: int,
    shards: int,
    q_itemsize: int,
) -> Work:
    """What the kernel calls of this batch move and compute on one chip, all layers: for
    each query block, each sequence in it fetches its KV in whole blocks of pages and
    multiplies the block's every query (and each query's heads) against them; each call
    reads its queries and writes its outputs (`tokens` padded rows, folded lanes)."""
    page_bytes = layout.page_bytes / shards
    lanes = layout.lanes
    total = Work(0.0, 0.0)
    for call in kernel_calls(layout, shape.q_lens, shape.kv_lens, tokens, pages_per_seq):
        kv_block = call.kv_pages_per_block * layout.page_size
        for q_blocks, kv_blocks in call.blocks(layout.page_size):
            fetched = q_blocks * kv_blocks * call.kv_pages_per_block * page_bytes
            products = 4.0 * q_blocks * kv_blocks * call.queries_per_block * kv_block
            total += Work(fetched, products * shape.heads * lanes)
        total += Work(2.0 * tokens * shape.heads * lanes * q_itemsize, 0.0)
    return Work(total.bytes * shape.layers, total.flops * shape.layers)


def spread(full: int, count: int) -> tuple[int, ...]:
    """`count` contexts spread evenly over 1..full (the midpoints of a uniform draw)."""
    return tuple(max(1, round((i + 0.5) * full / count)) for i in range(count))


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None
