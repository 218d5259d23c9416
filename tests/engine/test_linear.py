"""engine.model.linear: float32 accumulation and shapes, including the one-row 16-bit path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.model import linear


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_matches_float64_product(lead: tuple[int, ...], dtype: str) -> None:
    rng = np.random.default_rng(1)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((*lead, 48)), dt)
    w = jnp.asarray(rng.standard_normal((48, 40)), dt)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

    out = linear(x, w)
    wide = linear(x, w, preferred=jnp.float32)

    assert out.shape == (*lead, 40) and out.dtype == dt
    assert wide.shape == (*lead, 40) and wide.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(wide, np.float64), want, rtol=1e-5, atol=1e-4)
    # the narrow result is the float32-accumulated one, rounded once
    np.testing.assert_array_equal(np.asarray(out), np.asarray(wide.astype(dt)))
