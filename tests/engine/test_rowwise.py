"""engine.rowwise: a row's sum, mean, softmax and log-softmax have the same bits whatever
the other rows are and however many there are (what keeps a sequence's logits and
draws the same alone and in a full batch), and agree with numpy and jax.nn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import rowwise

FUNCTIONS = {
    "tree_sum": rowwise.tree_sum,
    "mean": rowwise.mean,
    "softmax": rowwise.softmax,
    "log_softmax": rowwise.log_softmax,
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("width", [256, 128256])  # a hidden size, a Llama 3 vocabulary
def test_a_row_has_the_same_bits_among_any_rows(name: str, width: int) -> None:
    rng = np.random.default_rng(width)
    x = rng.standard_normal((64, width)).astype(np.float32) * 4
    x[5, ::3] = -np.inf  # masked tokens, as sampling's filters leave them
    fn = jax.jit(FUNCTIONS[name])
    alone = [np.asarray(fn(x[i : i + 1]))[0] for i in (0, 5, 15, 16, 63)]
    for rows in (2, 8, 16, 32, 64):
        got = np.asarray(fn(x[:rows]))
        for want, i in zip(alone, (0, 5, 15, 16, 63), strict=True):
            if i < rows:
                np.testing.assert_array_equal(got[i], want, err_msg=f"{name}: row {i} of {rows}")


def test_values_match_numpy_and_jax_nn() -> None:
    x = np.random.default_rng(0).standard_normal((8, 1000)).astype(np.float32) * 4
    x[2, :500] = -np.inf
    np.testing.assert_allclose(rowwise.tree_sum(jnp.asarray(x[3:])), x[3:].sum(-1), rtol=1e-5)
    np.testing.assert_allclose(
        rowwise.mean(jnp.asarray(x[3:])), x[3:].mean(-1, keepdims=True), rtol=1e-4, atol=1e-6
    )
    for ours, theirs in (
        (rowwise.softmax, jax.nn.softmax),
        (rowwise.log_softmax, jax.nn.log_softmax),
    ):
        np.testing.assert_allclose(
            ours(jnp.asarray(x)), theirs(jnp.asarray(x), axis=-1), rtol=1e-5, atol=1e-7
        )
    masked = jnp.full((1, 16), -jnp.inf)  # nothing left: NaN, as jax.nn.softmax gives
    assert np.isnan(np.asarray(rowwise.softmax(masked))).all()


def test_the_backends_own_reduce_is_the_same_function() -> None:
    """tree=False (TPU's choice, ModelConfig.fixed_order_sums) sums with XLA's reduce:
    the same values to rounding."""
    x = np.random.default_rng(1).standard_normal((8, 4096)).astype(np.float32)
    np.testing.assert_allclose(rowwise.row_sum(jnp.asarray(x), tree=False), x.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(
        rowwise.mean(jnp.asarray(x), tree=False), rowwise.mean(jnp.asarray(x)), rtol=1e-5
    )
    np.testing.assert_allclose(
        rowwise.log_softmax(jnp.asarray(x), tree=False),
        rowwise.log_softmax(jnp.asarray(x)),
        rtol=1e-5,
    )
