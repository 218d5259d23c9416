"""engine.model.linear: float32 accumulation and shapes, including the one-row 16-bit path;
the decode step's vocabulary product in both layouts (engine.model.step_logits)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ModelConfig
from engine.model import linear, logits_of, matmul_layout, project, step_logits


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


def head_params(tied: bool, vocab_major: bool) -> tuple[dict, np.ndarray, np.ndarray]:
    """Checkpoint-layout head params through matmul_layout, and the float64 head and norm."""
    rng = np.random.default_rng(2)
    head = rng.standard_normal((1000, 32)).astype(np.float32)  # (vocab, hidden), as stored
    norm = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    params = {"embed": head, "layers": [], "final_norm": norm}
    if not tied:
        params["embed"] = rng.standard_normal((1000, 32)).astype(np.float32)
        params["lm_head"] = head
    laid = matmul_layout(params, vocab_major)
    assert ("vocab_head" in laid) == (vocab_major and not tied)  # tied: the embedding is it
    return jax.tree.map(jnp.asarray, laid), head.astype(np.float64), norm.astype(np.float64)


CFG = ModelConfig("LlamaForCausalLM", 1000, 32, 0, 1, 1, 32, 64, 1e-5, 1e4)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 32])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("vocab_major", [False, True], ids=["hidden-major", "vocab-major"])
def test_step_logits_in_either_layout_match_float64(rows: int, tied: bool, vocab_major: bool):
    params, head, norm = head_params(tied, vocab_major)
    cfg = dataclasses.replace(CFG, vocab_major_head=vocab_major)
    x = np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)
    normed = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    want = (normed * norm) @ head.T  # (rows, vocab)

    out = np.asarray(step_logits(params, jnp.asarray(x), cfg))

    assert out.dtype == np.float32
    assert out.shape == ((1000, rows) if vocab_major else (rows, 1000))
    np.testing.assert_allclose(out.T if vocab_major else out, want, rtol=1e-4, atol=1e-4)
    hidden_major = np.asarray(logits_of(params, jnp.asarray(x), CFG))
    if vocab_major and rows == 1:  # one row keeps the (hidden, vocab) product, bit for bit
        np.testing.assert_array_equal(out.T, hidden_major)
    if not vocab_major:
        np.testing.assert_array_equal(out, hidden_major)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 63, 64, 100])
@pytest.mark.parametrize("weights_left", [False, True], ids=["rows-left", "weights-left"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_project_matches_float64_in_every_form(rows: int, weights_left: bool, dtype: str):
    """(out, in) weights: 2-63 rows weights-left when asked, the rest rows x w^T; leading
    axes kept; the result in x's dtype, rounded once from the float32 sum."""
    rng = np.random.default_rng(rows)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((1, rows, 48)), dt)
    w = jnp.asarray(rng.standard_normal((40, 48)), dt)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T

    out = project(x, w, weights_left)

    assert out.shape == (1, rows, 40) and out.dtype == dt
    tolerance = 1e-4 if dtype == "float32" else 0.1
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tolerance, atol=tolerance)
    wide = jax.lax.dot_general(
        x[0], w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    np.testing.assert_allclose(
        np.asarray(out[0], np.float32), np.asarray(wide.astype(dt), np.float32), atol=2e-2
    )
