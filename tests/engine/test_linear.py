"""engine.model.linear: float32 accumulation and shapes, including the one-row 16-bit path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.model import HEAD_TILE_MAX_ROWS, head_product, linear


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


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 33, 64])
@pytest.mark.parametrize("tile", [96, 250, 1000])
def test_head_product_by_tiles_matches_one_product(rows: int, tile: int) -> None:
    """1000 columns in tiles of 96 (11 of 91, the last overlapping the one before) or 250
    (4, no overlap); 1000 is one product. 1 row and more than HEAD_TILE_MAX_ROWS are one
    product by design."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((rows, 32)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((32, 1000)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(head, np.float64)

    out = head_product(x, head, tile)

    assert out.shape == (rows, 1000) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-4)
    if rows == 1 or rows > HEAD_TILE_MAX_ROWS or tile >= 1000:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(head_product(x, head)))


def test_head_product_by_tiles_keeps_leading_axes_and_16_bit_weights() -> None:
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((32, 500)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(head, np.float64)

    out = head_product(x, head, 64)

    assert out.shape == (2, 3, 500) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-3)


def test_a_rows_tiled_logits_do_not_depend_on_the_row_count_where_one_products_do_not() -> None:
    """The property the engine's prefill and decode buckets rely on (checked at start by
    Engine._shared_row_kernel): tiles of one shape keep it wherever the whole product has it."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((64, 3000)), jnp.float32)

    def first_row_bits(tile: int) -> list[bytes]:
        return [np.asarray(head_product(x[:n], head, tile))[0].tobytes() for n in range(2, 17)]

    whole = first_row_bits(0)
    if len(set(whole)) != 1:
        pytest.skip("this backend's matrix kernel rounds a row differently by row count")
    assert len(set(first_row_bits(320))) == 1
