"""engine.model's backend forms: RoPE's rotation as a product with a signed permutation
(TPU's) gives the bits of swapped half-width slices (the reference) in float32 and bfloat16,
and matches the rotate-half formula as written; the row-parallel products' partials in
the model's dtype (TPU's) stay within bfloat16 rounding of the float32 sum over a split
input axis, and a layer in TPU's forms within it of the reference layer; engine.core.core
keys the forms on the platform. The SwiGLU in bfloat16 rounds where transformers' does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.config import load_model_config, tensor_parallel
from engine.core.core import backend_numerics
from engine.model import apply_rope, layer_output, project, rope_tables, swiglu


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_by_product_has_the_bits_of_rope_by_slices(dtype, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(head_dim)
    x = jnp.asarray(rng.standard_normal((37, 8, head_dim)) * 3, dtype)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    cos, sin = rope_tables(jnp.arange(37) * 11, jnp.asarray(inv_freq), dtype)
    halves = jax.jit(lambda x: apply_rope(x, cos, sin))(x)
    product = jax.jit(lambda x: apply_rope(x, cos, sin, by_product=True))(x)
    np.testing.assert_array_equal(np.asarray(product, np.float32), np.asarray(halves, np.float32))
    # and both are x cos + rotate_half(x) sin
    half = head_dim // 2
    rotated = np.concatenate([-np.asarray(x[..., half:]), np.asarray(x[..., :half])], -1)
    c = np.concatenate([cos, cos], -1)[:, None, :]
    s = np.concatenate([sin, sin], -1)[:, None, :]
    want = np.asarray(x, np.float32) * c.astype(np.float32) + rotated.astype(np.float32) * s.astype(
        np.float32
    )
    loose = dtype == jnp.bfloat16  # each product rounded to 8 bits before the add
    tol = {"rtol": 2e-2, "atol": 0.1} if loose else {"rtol": 1e-6, "atol": 1e-5}
    np.testing.assert_allclose(np.asarray(halves, np.float32), want, **tol)


def test_the_tpu_gets_its_forms_and_other_backends_the_reference(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    cfg = load_model_config(tiny_checkpoint_of("llama"))
    assert cfg.fixed_order_sums and not cfg.rope_by_product
    for platform in ("gpu", "cuda"):
        assert backend_numerics(cfg, platform) == cfg
    # XLA:CPU: the reference forms, its products through engine.row_dot's kernel
    assert backend_numerics(cfg, "cpu") == replace(cfg, row_products=True)
    assert not backend_numerics(tensor_parallel(cfg, 2), "cpu").row_products  # one device only
    tpu = backend_numerics(cfg, "tpu")
    assert not tpu.fixed_order_sums and tpu.rope_by_product and tpu.partials_in_dtype
    assert not cfg.partials_in_dtype and not cfg.row_products and not tpu.row_products


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def test_partials_in_dtype_over_a_split_input_axis_stay_near_the_float32_sum() -> None:
    devices = jax.devices()[:4]
    if len(devices) < 2:
        pytest.skip("needs several devices (tests/conftest.py asks XLA:CPU for 4)")
    mesh = Mesh(np.array(devices), ("model",))
    rng = np.random.default_rng(0)
    x, w = _bf16(rng, 24, 512), _bf16(rng, 96, 512, scale=0.05)
    # the row-parallel layout: the input axis split over the devices, the output whole
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "model")))
    ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, "model")))
    whole = NamedSharding(mesh, PartitionSpec())
    reference = jax.jit(project, out_shardings=whole)(xs, ws)
    tpu = jax.jit(lambda a, b: project(a, b, partials=jnp.bfloat16), out_shardings=whole)(xs, ws)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(reference, np.float64), exact, rtol=8e-3, atol=1e-2)
    # each device's partial and their sum rounded: a few bfloat16 steps of the sum at most
    step = np.abs(exact) * 2.0**-8 + 1e-3
    assert np.all(np.abs(np.asarray(tpu, np.float64) - exact) <= 4 * step)


def test_a_layer_in_the_tpu_forms_stays_near_the_reference_layer(
    tiny_checkpoint_of: Callable[..., Path],
) -> None:
    cfg = load_model_config(tiny_checkpoint_of("llama"))
    tpu = backend_numerics(cfg, "tpu")
    rng = np.random.default_rng(1)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    lp = {
        "wo": _bf16(rng, h, cfg.q_size, scale=0.1),
        "mlp_norm": jnp.ones((h,), jnp.bfloat16),
        "w_gate_up": _bf16(rng, 2 * inter, h, scale=0.1),
        "w_down": _bf16(rng, h, inter, scale=0.1),
    }
    x, attn = _bf16(rng, 19, h), _bf16(rng, 19, cfg.q_size)
    reference = jax.jit(lambda: layer_output(lp, x, attn, cfg))()
    form = jax.jit(lambda: layer_output(lp, x, attn, tpu))()
    np.testing.assert_allclose(
        np.asarray(form, np.float32), np.asarray(reference, np.float32), rtol=2e-2, atol=2e-2
    )


def test_swiglu_in_bfloat16_rounds_where_transformers_does() -> None:
    """silu(gate) rounded once, then times up: torch's bfloat16 SiLU computes in float32
    and rounds once. Only the exponential's last bit may differ (a rare rounding tie);
    jax.nn.silu on bfloat16 rounds after each op and misses many more."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((64, 1536)).astype(np.float32) * 4 for _ in range(2))
    g, u = jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16)
    ours = np.asarray(jax.jit(swiglu)(g, u).astype(jnp.float32))
    tg, tu = (torch.from_numpy(np.array(a.astype(jnp.float32))).bfloat16() for a in (g, u))
    theirs = (torch.nn.functional.silu(tg) * tu).float().numpy()
    chained = np.asarray((jax.nn.silu(g) * u).astype(jnp.float32))
    same, same_chained = (np.mean(a == theirs) for a in (ours, chained))
    assert same > 0.999, same
    assert same_chained < 0.99, same_chained  # the check tells the two apart
    np.testing.assert_allclose(ours, theirs, rtol=2**-7, atol=0)
