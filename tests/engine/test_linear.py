"""engine.model.project, every layer's product: rows x w^T summed in float32 matches a
float64 product, and a row gets the same bits at every row count a step can take (from
engine.core.runner's smallest buckets up), in float32 and bfloat16. The second is what
makes a sequence's tokens the same alone and in a full batch; it is a property of the
backend's kernels, checked here on the machine that runs the suite."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine.core.shapes import MIN_SEQS_BUCKET, MIN_TOKENS_BUCKET
from engine.model import project

SHAPES = [(64, 64), (256, 1408), (704, 256), (64, 512)]  # (in, out): layers and a head


@pytest.mark.parametrize(("inner", "outer"), SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_project_matches_float64(inner: int, outer: int, dtype: str) -> None:
    rng = np.random.default_rng(inner + outer)
    x = rng.standard_normal((8, inner)).astype(dtype)
    w = rng.standard_normal((outer, inner)).astype(dtype)
    got = np.asarray(jax.jit(project)(x, w), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    tol = 1e-4 if dtype == "float32" else 5e-2 * np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=tol * max(1.0, np.sqrt(inner) / 8), rtol=1e-3)


@pytest.mark.parametrize(("inner", "outer"), SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_has_the_same_bits_at_every_step_width(inner: int, outer: int, dtype: str) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, inner)).astype(dtype)
    w = rng.standard_normal((outer, inner)).astype(dtype)
    product = jax.jit(project)
    widest = np.asarray(product(x, w))
    smallest = min(MIN_SEQS_BUCKET, MIN_TOKENS_BUCKET)  # the head's rows: one per sequence
    for rows in sorted({smallest, 8, 16, 32, 64, 128}):
        assert np.array_equal(np.asarray(product(x[:rows], w)), widest[:rows]), rows
