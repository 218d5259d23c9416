"""The Llama-family decoder layer as pure functions: the math every step runs.

Owns: RMSNorm, RoPE, a layer's q/k/v projections and its output projection and SwiGLU
MLP, for Llama (default / linear / llama3 RoPE), Mistral (sliding window) and Qwen2
(q/k/v bias), grouped-query attention, tied or untied embeddings. Receives a layer's
params and rows (T, hidden); emits rows. Attention itself is engine.attention's and the
whole step is engine.paged_model's.

Layout: layer weights (out, in), as the checkpoint has them; engine.paged_model stacks
them by layer and scans the layers, handing each layer its slices, or, for the products
engine.row_dot runs, the whole stack and the layer's index (`layer`). With tensor
parallelism (engine.config.tensor_parallel) the fused q/k/v and gate/up weights hold
one group of columns per device.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from engine import row_dot, rowwise
from engine.config import ModelConfig

Params = dict[str, Any]
F32 = jnp.float32


def project(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    partials: DTypeLike = F32,
    kernel: bool = False,
    layer: jax.Array | None = None,
    live: jax.Array | None = None,
) -> jax.Array:
    """x (..., in) times w (out, in)^T -> (..., out) in x's dtype, summed in float32.

    Rows x w^T as stored: XLA:CPU gives a row the same bits in this product at any row
    count from 2 (4 in bfloat16), which steps always have (engine.core.runner's buckets).
    With `scale` (out,), w is int8 (engine.quant): its values converted to x's dtype
    (exact) go into the product, and each output column is multiplied by its scale.
    `partials`: the product's own dtype (ModelConfig.partials_in_dtype), which is what a
    device's share of a split `in` axis leaves in before they are summed; int8 keeps
    float32 for its scale.
    `kernel` (ModelConfig.row_products): float32 rows and weights through engine.row_dot,
    and bfloat16 ones where its bfloat16 form is native (`row_dot.serves`), whose bits
    for a row are the same at any row count from 1; XLA's product otherwise.
    `layer`: w is every layer's weight stacked (L, out, in) and this layer's is used
    (the kernel reads it in place; XLA's product takes a copy of it), or such a stack
    `row_dot.pack`ed (engine.paged_model.packed_products), which only the kernel reads.
    `live`: rows of x from this one on are a step's padding, which the kernel skips
    (zeros); XLA's product computes every row.
    """
    rows = x.reshape(-1, x.shape[-1])
    if kernel and scale is None and rows.dtype == w.dtype and row_dot.serves(w.dtype):
        out = row_dot.row_dot(rows, w, layer, live)
        return out.astype(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
    if layer is not None:
        w = lax.dynamic_index_in_dim(w, layer, keepdims=False)
    if scale is not None:
        w, partials = w.astype(x.dtype), F32
    out = lax.dot_general(rows, w, (((1,), (1,)), ((), ())), preferred_element_type=partials)
    if scale is not None:
        out = out * scale
    return out.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """Each row's LoRA term x A[slot] B[slot] (engine.lora's pool: a (slots, in, rank), b
    (slots, rank, out)); `slots` (rows,) int32, a row's slot (outside the pool: none, a
    zero term). One product per factor over every slot, the other slots' terms masked
    to zeros before the second: a row's bits are its own whatever the others' adapters,
    and the pool's contents change without a recompile. x A is rounded to x's dtype
    before B, as PEFT's two linear layers round it."""
    rows = x.reshape(-1, x.shape[-1])
    xa = lax.dot_general(rows, a, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    mine = slots[:, None, None] == jnp.arange(a.shape[0])[None, :, None]
    xa = jnp.where(mine, xa, 0.0).astype(x.dtype)
    out = lax.dot_general(xa, b, (((1, 2), (0, 1)), ((), ())), preferred_element_type=F32)
    return out.astype(x.dtype).reshape(*x.shape[:-1], b.shape[-1])


def _project(
    lp: Params,
    x: jax.Array,
    name: str,
    cfg: ModelConfig,
    lora: jax.Array | None = None,
    partials: DTypeLike = F32,
    layer: jax.Array | None = None,
    live: jax.Array | None = None,
) -> jax.Array:
    """x through layer weight `name`, int8 with its scale when engine.quant made it so;
    with `lora` (each row's slot) and a pool beside the weight, plus each row's LoRA term.
    A weight given stacked (engine.paged_model.in_place_weights) is layer `layer`'s;
    `live` as `project` takes it."""
    w = lp[name]
    index = layer if w.ndim >= 3 else None  # stacked (packed: 4 axes)
    out = project(x, w, lp.get(name + "_scale"), partials, cfg.row_products, index, live)
    if lora is not None and "lora_a_" + name in lp:
        out = out + lora_delta(x, lp["lora_a_" + name], lp["lora_b_" + name], lora)
    return out


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, tree: bool = True) -> jax.Array:
    """`tree`: the mean as a fixed tree of adds, the same bits in any batch (engine.rowwise)."""
    xf = x.astype(F32)
    normed = xf * lax.rsqrt(rowwise.mean(xf * xf, tree) + eps)
    return weight * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype: Any) -> tuple[jax.Array, ...]:
    """cos, sin of shape positions.shape + (head_dim // 2,): one angle per pair of lanes
    (the rotate-half convention pairs lane i with lane i + head_dim // 2)."""
    freqs = positions.astype(F32)[..., None] * inv_freq
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, by_product: bool = False) -> jax.Array:
    """x (..., heads, head_dim); cos/sin (..., head_dim // 2) broadcast over heads:
    x cos + rotate_half(x) sin. rotate_half(x) is two half-width slices swapped, or with
    `by_product` x times a signed permutation (one nonzero term per output, so exact at
    HIGHEST precision): the same bits without half-width copies, which TPU pads to 128
    lanes (ModelConfig.rope_by_product)."""
    d = x.shape[-1]
    half = d // 2
    if by_product:
        perm = np.zeros((d, d), np.float32)
        perm[np.arange(half, d), np.arange(half)] = -1.0  # out[i] = -x[i + half]
        perm[np.arange(half), np.arange(half, d)] = 1.0  # out[i + half] = x[i]
        rotated = lax.dot_general(
            x, jnp.asarray(perm, x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype,
        )  # fmt: skip
    else:
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = jnp.concatenate([cos, cos], axis=-1)[..., None, :]
    s = jnp.concatenate([sin, sin], axis=-1)[..., None, :]
    return x * c + rotated * s


def attention_inputs(
    lp: Params,
    x: jax.Array,
    cfg: ModelConfig,
    cos: jax.Array,
    sin: jax.Array,
    lora: jax.Array | None = None,
    layer: jax.Array | None = None,
    live: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`lora`: each row's adapter slot (engine.lora), None without adapters; `layer`: the
    layer's index, for weights given stacked; `live`: rows from it on are padding."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.fixed_order_sums)
    qkv = _project(lp, h, "wqkv", cfg, lora, layer=layer, live=live)
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"]
    lead = x.shape[:-1]
    # per tensor-parallel shard its q, k, v columns (one shard: the checkpoint's order)
    qkv = qkv.reshape(*lead, cfg.shards, -1)
    q_end = cfg.q_size // cfg.shards
    k_end = q_end + cfg.kv_size // cfg.shards
    q = qkv[..., :q_end].reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = qkv[..., q_end:k_end].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., k_end:].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    rope = functools.partial(apply_rope, cos=cos, sin=sin, by_product=cfg.rope_by_product)
    return rope(q), rope(k), v


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in their dtype, the SiLU computed in float32 and rounded once, as
    transformers computes it in bfloat16 (jax.nn.silu on bfloat16 rounds after each of
    its four ops, and XLA:CPU's loop over that chain took 1.6x the time)."""
    return jax.nn.silu(gate.astype(F32)).astype(gate.dtype) * up


def layer_output(
    lp: Params,
    x: jax.Array,
    attn: jax.Array,
    cfg: ModelConfig,
    lora: jax.Array | None = None,
    layer: jax.Array | None = None,
    live: jax.Array | None = None,
) -> jax.Array:
    """Output projection, residual, and the SwiGLU MLP block."""
    partials = x.dtype if cfg.partials_in_dtype else F32  # of the row-parallel products
    out = _project(lp, attn, "wo", cfg, lora, partials, layer, live)
    if "bo" in lp:
        out = out + lp["bo"]
    x = x + out
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, cfg.fixed_order_sums)
    lead = x.shape[:-1]
    gate_up = _project(lp, h, "w_gate_up", cfg, lora, layer=layer, live=live)
    gate_up = gate_up.reshape(*lead, cfg.shards, -1)  # per shard gate, up
    half = cfg.intermediate_size // cfg.shards
    gated = swiglu(gate_up[..., :half], gate_up[..., half:])
    gated = gated.reshape(*lead, cfg.intermediate_size)
    return x + _project(lp, gated, "w_down", cfg, lora, partials, layer, live)
