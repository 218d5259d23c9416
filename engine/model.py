"""The Llama-family decoder layer as pure functions: the math every step runs.

Owns: RMSNorm, RoPE, a layer's q/k/v projections and its output projection and SwiGLU
MLP, for Llama (default / linear / llama3 RoPE), Mistral (sliding window) and Qwen2
(q/k/v bias), grouped-query attention, tied or untied embeddings. Receives a layer's
params and rows (T, hidden); emits rows. Attention itself is engine.attention's and the
whole step is engine.paged_model's.

Layout: layer weights (out, in), as the checkpoint has them, one set of arrays per layer
(the layer loop is unrolled, so no weight is ever sliced or copied). With tensor
parallelism (engine.config.tensor_parallel) the fused q/k/v and gate/up weights hold
one group of columns per device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from engine import rowwise
from engine.config import ModelConfig

Params = dict[str, Any]
F32 = jnp.float32


def project(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """x (..., in) times w (out, in)^T -> (..., out) in x's dtype, summed in float32.

    Rows x w^T as stored: XLA:CPU gives a row the same bits in this product at any row
    count from 2 (4 in bfloat16), which steps always have (engine.core.runner's buckets).
    With `scale` (out,), w is int8 (engine.quant): its values converted to x's dtype
    (exact) go into the product, and each output column is multiplied by its scale.
    """
    rows = x.reshape(-1, x.shape[-1])
    if scale is not None:
        w = w.astype(x.dtype)
    out = lax.dot_general(rows, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    if scale is not None:
        out = out * scale
    return out.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _project(lp: Params, x: jax.Array, name: str) -> jax.Array:
    """x through layer weight `name`, int8 with its scale when engine.quant made it so."""
    return project(x, lp[name], lp.get(name + "_scale"))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(F32)
    normed = xf * lax.rsqrt(rowwise.mean(xf * xf) + eps)  # the same bits in any batch
    return weight * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype: Any) -> tuple[jax.Array, ...]:
    """cos, sin of shape positions.shape + (head_dim,), in the rotate-half convention."""
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (..., heads, head_dim); cos/sin (..., head_dim) broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def attention_inputs(
    lp: Params, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = _project(lp, h, "wqkv")
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
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(lp: Params, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Output projection, residual, and the SwiGLU MLP block."""
    out = _project(lp, attn, "wo")
    if "bo" in lp:
        out = out + lp["bo"]
    x = x + out
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    lead = x.shape[:-1]
    gate_up = _project(lp, h, "w_gate_up")
    gate_up = gate_up.reshape(*lead, cfg.shards, -1)  # per shard gate, up
    half = cfg.intermediate_size // cfg.shards
    gated = jax.nn.silu(gate_up[..., :half]) * gate_up[..., half:]
    return x + _project(lp, gated.reshape(*lead, cfg.intermediate_size), "w_down")
