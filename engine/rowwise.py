"""Row-wise float reductions whose result for a row does not depend on the other rows.

Owns: `tree_sum` and the softmax family built on it. Receives arrays reduced over their
last axis; emits one value (or one normalized row) per row.

XLA's reduce orders its adds by the whole array's shape: on XLA:CPU a row's jnp.sum over
256 or 128k positions takes other bits once the array has 16 or more rows (2 or more
over a 128k vocabulary), and so do jnp.mean and jax.nn.softmax. A sequence's logits and
draws would then depend on how many others share its step. A fixed tree of elementwise
adds gives a row the same bits in any batch (tests/engine/test_rowwise.py).

`tree=False` takes XLA's own reduce instead: for a backend where it already keeps a row's
bits and the tree costs a pass over memory per level (TPU, chosen in engine.core.core by
`ModelConfig.fixed_order_sums`); the tree is the reference either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed tree of elementwise adds: the same bits for a
    row whatever the array's other dimensions (jnp.sum's order depends on them)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        head = x[..., :half] + x[..., half : 2 * half]
        x = jnp.concatenate([head, x[..., 2 * half :]], axis=-1) if x.shape[-1] % 2 else head
    return x[..., 0]


def row_sum(x: jax.Array, tree: bool = True) -> jax.Array:
    """Sum over the last axis: `tree_sum`, or XLA's reduce (tree=False)."""
    return tree_sum(x) if tree else jnp.sum(x, axis=-1)


def mean(x: jax.Array, tree: bool = True) -> jax.Array:
    """Mean over the last axis, keeping it (as jnp.mean(..., keepdims=True))."""
    return (row_sum(x, tree) / x.shape[-1])[..., None]


def _shifted(x: jax.Array) -> jax.Array:
    """x less its row's max (a row of -inf stays -inf, as jax.nn.softmax has it)."""
    top = jnp.max(x, axis=-1, keepdims=True)  # a max is exact in any order
    return x - jnp.where(jnp.isfinite(top), top, 0.0)


def softmax(x: jax.Array) -> jax.Array:
    """jax.nn.softmax over the last axis."""
    e = jnp.exp(_shifted(x))
    return e / tree_sum(e)[..., None]


def log_softmax(x: jax.Array, tree: bool = True) -> jax.Array:
    """jax.nn.log_softmax over the last axis."""
    shifted = _shifted(x)
    return shifted - jnp.log(row_sum(jnp.exp(shifted), tree))[..., None]
