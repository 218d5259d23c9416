"""engine.model's backend forms: RoPE's rotation as a product with a signed permutation
(TPU's) gives the bits of swapped half-width slices (the reference) in float32 and bfloat16,
and matches the rotate-half formula as written; engine.core.core keys the forms on the
platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import load_model_config
from engine.core.core import backend_numerics
from engine.model import apply_rope, rope_tables


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
    for platform in ("cpu", "gpu", "cuda"):
        assert backend_numerics(cfg, platform) == cfg
    tpu = backend_numerics(cfg, "tpu")
    assert not tpu.fixed_order_sums and tpu.rope_by_product
