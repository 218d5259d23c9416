"""Weight-only int8 quantization: per output channel, symmetric, applied once at load.

Owns: the quantization (of engine.types.QUANTIZATIONS' choices) of one weight
(`quantize_weight`) and of a whole placed param tree (`quantize_params`), and the bytes
params take (`param_bytes`). Receives params in the checkpoint's layout, already on
their mesh (engine.mesh.place_checkpoint_params); emits the same tree with every matmul
weight (each layer's wqkv, wo, w_gate_up, w_down, and the head: the embedding when
tied, which is then looked up from the int8 rows too) replaced by int8 values, plus a
float32 scale per output row under `<name>_scale`. engine.model.project and
engine.paged_model consume that form; norms and biases stay in the model's dtype.

A weight w (out, in) becomes q = round(w / s) in [-127, 127] with s = max|w[o]| / 127
per output row o (a row of zeros gets s = 1). The product is then
dot(x, q.astype(x.dtype)) * s, summed in float32: only the int8 weight is read, the
scale applies to the (rows, out) result.

Quantization runs on the devices, jitted under the params' own shardings: a weight
split by its input axis (wo, w_down under tensor parallelism) gets each row's maximum
over every device's columns, so the scales are the same whatever the mesh; the scale
of a weight split by its output axis is split with it, else it is a copy per device.

Hand-written rather than qwix's (PyPI qwix 0.1.8): qwix's functional API
(qwix.quantize + qwix.dot_general) would fit dict params, but for a float activation
and a quantized weight its dot_general takes its "dequantize the inputs first" path
(the weight times its scale in the scale's dtype, then a float product), and installing
it brings 15 packages (flax, orbax-checkpoint, tensorstore, optax, protobuf, ...) into
an engine whose model uses none (bench/README.md, "Quantization").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from engine.types import QUANTIZATIONS

Params = dict[str, Any]

LAYER_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
HEAD_WEIGHTS = ("embed", "lm_head")  # both (vocab, hidden): scales per vocabulary row
INT8_MAX = 127.0
SCALE = "_scale"


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w (out, in) -> int8 values (out, in) and float32 scales (out,)."""
    wf = w.astype(jnp.float32)
    top = jnp.max(jnp.abs(wf), axis=1)
    scale = jnp.where(top > 0, top / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(wf / scale[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_weight(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """The full-precision weight int8 values and scales stand for (tests and reports)."""
    return (q.astype(jnp.float32) * scale[:, None]).astype(dtype)


def scale_sharding(sharding: Any) -> Any:
    """A weight's scale placed as the weight's output axis is (None: as jit chooses)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if spec else None))


def _quantize_placed(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    placement = scale_sharding(w.sharding)
    if placement is None:
        return jax.jit(quantize_weight)(w)
    return jax.jit(quantize_weight, out_shardings=(w.sharding, placement))(w)


def quantized_shapes(params: Params) -> Params:
    """quantize_params' result as abstract arrays, from abstract params with shardings
    (bench.tpu_aot compiles against them)."""

    def pair(w: Any) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        q = jax.ShapeDtypeStruct(w.shape, jnp.int8, sharding=w.sharding)
        scale = jax.ShapeDtypeStruct(w.shape[:1], jnp.float32, sharding=scale_sharding(w.sharding))
        return q, scale

    out: Params = {k: v for k, v in params.items() if k != "layers"}
    for name in HEAD_WEIGHTS:
        if name in params:
            out[name], out[name + SCALE] = pair(params[name])
    out["layers"] = []
    for lp in params["layers"]:
        qp = dict(lp)
        for name in LAYER_WEIGHTS:
            qp[name], qp[name + SCALE] = pair(lp[name])
        out["layers"].append(qp)
    return out


def quantize_params(params: Params, quantization: str) -> Params:
    """params with every matmul weight int8 and its scale beside it (`quantization`
    "none": params as they are)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return params
    out: Params = {}
    for name, value in params.items():
        if name == "layers":
            continue
        if name in HEAD_WEIGHTS:
            out[name], out[name + SCALE] = _quantize_placed(value)
        else:
            out[name] = value
    layers = []
    for lp in params["layers"]:
        qp = dict(lp)
        for name in LAYER_WEIGHTS:
            qp[name], qp[name + SCALE] = _quantize_placed(lp[name])
        layers.append(qp)
    out["layers"] = layers
    return out


def is_quantized(params: Params) -> bool:
    return "embed" + SCALE in params


def param_bytes(params: Params) -> int:
    """Bytes of every param array (global arrays: all devices' shards together)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(params))
