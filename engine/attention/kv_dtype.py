"""8-bit KV pages: the `--kv-cache-dtype` choices and how a row of K or V is stored.

Owns: KV_CACHE_DTYPES (vLLM's names), the page dtype each one stores (`storage_dtype`),
and the encoding of one (token, head) row of keys or values in that dtype (`encode`)
and back to float32 (`decode`). Receives rows (..., lanes) in the model's dtype; emits
rows (..., lanes + scale_lanes(dtype)) in the page dtype, and float32 rows back.
engine.attention.layout stores what `encode` gives; every backend reads through `decode`.

- int8: a scale per (token, kv head) row, max|row| / 127 rounded to bfloat16, kept in
  the row's last 2 int8 lanes (its bfloat16 bits): a row's bits depend on that row
  alone, so a token's K/V read the same whatever else is in the batch. Bytes per
  (token, head): head_dim + 2 (0.52x bfloat16 at head_dim 64, 0.51x at 128).
- fp8 (= fp8_e4m3, float8_e4m3fn) and fp8_e5m2: the value itself, clipped to the
  format's range, with a scale of 1 (vLLM's default with no calibrated scales): exactly
  half of bfloat16, and the form jax's TPU kernel reads (engine.attention.tpu).
- auto: the model's dtype, stored as is (decode only casts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORED = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
_STORED["fp8_e5m2"] = "float8_e5m2"
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
INT8_MAX = 127.0
INT8_SCALE_LANES = 2  # a bfloat16 scale's bits


def storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The pages' dtype for a --kv-cache-dtype choice."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return _STORED.get(kv_cache_dtype, model_dtype)


def is_quantized(dtype: str) -> bool:
    return dtype == "int8" or dtype in FP8_DTYPES


def scale_lanes(dtype: str) -> int:
    """Lanes after a row's values that hold its scale."""
    return INT8_SCALE_LANES if dtype == "int8" else 0


def encode(rows: jax.Array, dtype: str) -> jax.Array:
    """Rows (..., lanes) -> (..., lanes + scale_lanes(dtype)) in `dtype`."""
    if dtype == "int8":
        x = rows.astype(F32)
        top = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        scale = (top / INT8_MAX).astype(jnp.bfloat16)
        s = scale.astype(F32)
        q = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1.0)), -INT8_MAX, INT8_MAX)
        bits = lax.bitcast_convert_type(scale[..., 0], jnp.int8)  # (..., 2)
        return jnp.concatenate([q.astype(jnp.int8), bits], axis=-1)
    if dtype in FP8_DTYPES:
        bound = float(jnp.finfo(dtype).max)  # past it the cast gives NaN (e4m3fn has no inf)
        return jnp.clip(rows.astype(F32), -bound, bound).astype(dtype)
    return rows.astype(dtype)


def decode(rows: jax.Array, dtype: str) -> jax.Array:
    """Stored rows (..., lanes + scale_lanes) -> float32 (..., lanes)."""
    if dtype == "int8":
        values = rows[..., :-INT8_SCALE_LANES].astype(F32)
        scale = lax.bitcast_convert_type(rows[..., -INT8_SCALE_LANES:], jnp.bfloat16)
        return values * scale.astype(F32)[..., None]
    return rows.astype(F32)
