"""The decode step's KV-cache write: exact in every cache dtype, and no whole-cache copies.

A bfloat16 cache is written by a select rather than a scatter (XLA's CPU backend
converts a bfloat16 scatter target to float32 and back), only into chunks that
hold some slot's position; both must put each slot's column at its position and
leave every other entry alone.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.engine import Engine, EngineConfig
from engine.model import _write_chunk

SLOTS, KV, HEAD_DIM, CHUNK, CHUNKS, BLOCK = 3, 2, 4, 8, 3, 4


def _key_chunks(full: np.ndarray) -> list[np.ndarray]:
    """(slots, kv, head_dim, positions) keys -> the cache's chunks of key blocks."""
    return [
        c.reshape(SLOTS, KV, HEAD_DIM, CHUNK // BLOCK, BLOCK).transpose(0, 1, 3, 2, 4)
        for c in np.split(full, CHUNKS, axis=3)
    ]


def _expected(cache: np.ndarray, new: np.ndarray, positions: np.ndarray, keys: bool) -> list:
    """Reference write on the whole (unchunked) cache, then split into chunks."""
    full = cache.copy()
    for slot, pos in enumerate(positions):
        if keys:
            full[slot, :, :, pos] = new[slot]
        else:
            full[slot, :, pos, :] = new[slot]
    return _key_chunks(full) if keys else np.split(full, CHUNKS, axis=2)


@pytest.mark.parametrize(
    "positions",
    [
        [0, CHUNK + 3, CHUNK * CHUNKS - 1],  # three different chunks
        [CHUNK + 1, 2, CHUNK + 1],  # the last chunk holds no position: left as it is
    ],
)
@pytest.mark.parametrize("rows", [SLOTS, SLOTS - 1])  # every slot; a decode batch bucket
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_position_sets_each_slot_column_and_nothing_else(
    dtype: str, positions: list[int], rows: int
) -> None:
    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    k_full = rng.standard_normal((SLOTS, KV, HEAD_DIM, CHUNK * CHUNKS)).astype(np.float32)
    v_full = rng.standard_normal((SLOTS, KV, CHUNK * CHUNKS, HEAD_DIM)).astype(np.float32)
    k_full = np.asarray(jnp.asarray(k_full, dt).astype(jnp.float32))
    v_full = np.asarray(jnp.asarray(v_full, dt).astype(jnp.float32))
    k_new = np.asarray(jnp.asarray(rng.standard_normal((SLOTS, KV, HEAD_DIM)), dt), np.float32)
    v_new = np.asarray(jnp.asarray(rng.standard_normal((SLOTS, KV, HEAD_DIM)), dt), np.float32)
    positions = np.array(positions, np.int32)[:rows]
    k_new, v_new = k_new[:rows], v_new[:rows]

    k_chunks = tuple(jnp.asarray(c, dt) for c in _key_chunks(k_full))
    v_chunks = tuple(jnp.asarray(c, dt) for c in np.split(v_full, CHUNKS, axis=2))
    write = jax.jit(_write_chunk, static_argnames=("index",))
    written = [
        write(kc, vc, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(positions), index=i)
        for i, (kc, vc) in enumerate(zip(k_chunks, v_chunks, strict=True))
    ]
    got_k, got_v = [k for k, _ in written], [v for _, v in written]

    for got, want in zip(got_k, _expected(k_full, k_new, positions, keys=True), strict=True):
        assert got.dtype == dt
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    for got, want in zip(got_v, _expected(v_full, v_new, positions, keys=False), strict=True):
        assert got.dtype == dt
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_bfloat16_decode_step_does_not_widen_the_cache(tiny_checkpoint_of) -> None:
    """No float32 array of a cache chunk's shape in the compiled bfloat16 step's entry.

    Such an array is a whole-chunk conversion, which made the 100M model's
    16-slot bfloat16 step ~5x slower than it is without one.
    """
    engine = Engine(
        EngineConfig(tiny_checkpoint_of("llama"), dtype="bfloat16", max_slots=2, max_model_len=64)
    )
    state = engine.init_state()
    chunk_shapes = {tuple(c.shape) for layer in state.k_cache + state.v_cache for c in layer}
    args = (engine.params, state, engine._inv_freq, engine._eos_mask)
    text = engine._generate.lower(*args, rows=engine.max_slots).compile().as_text()
    text = text[text.index("\nENTRY") :]  # materialized arrays; fusion bodies are loops
    widened = {
        shape
        for shape in chunk_shapes
        if re.search(r"= f32\[" + ",".join(map(str, shape)) + r"\]", text)
    }
    assert not widened, widened
