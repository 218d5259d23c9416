"""engine.attention.layout's `bits`: 16- and 8-bit float pages kept in unsigned integer
arrays on XLA:CPU. The same bits are stored and read as without it, CpuAttention gives
the same output bits, and a compiled step over such pages holds no float array the size
of the whole cache (without `bits`, XLA:CPU converts the whole cache on every write and
read: the control case below, which says so if a later XLA stops doing it)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.attention import AttentionBatch, CpuAttention, KVLayout
from engine.paged_model import Chunk, make_batch

PAGE = 16
KV_HEADS, GROUPS, DIM = 2, 2, 32
DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "float32")
ARRAY = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
FLOATS = ("f64", "f32", "f16", "bf16", "f8e4m3fn", "f8e5m2")


def layout(dtype: str, bits: bool, num_pages: int = 16) -> KVLayout:
    return KVLayout(num_pages, PAGE, KV_HEADS, DIM, dtype, bits=bits)


def random_kv(n: int, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    k, v = rng.standard_normal((2, n, KV_HEADS, DIM)).astype(np.float32)
    return jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)


def batch(num_pages: int) -> tuple[AttentionBatch, jax.Array]:
    """Two decode rows and a 6-query chunk, and the flat slots of their new K/V."""
    chunks = [Chunk([0], 5, [3]), Chunk([0], 40, [7, 9, 11]), Chunk([0] * 6, 10, [2])]
    step = make_batch(
        chunks, tokens=8, seqs=4, pages_per_seq=4, page_size=PAGE, num_pages=num_pages
    )
    slots = [3 * PAGE + 5, 11 * PAGE + 40 % PAGE] + [2 * PAGE + p for p in range(10, 16)]
    return step.attention, jnp.asarray(slots, jnp.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pages_kept_as_bits_store_and_read_the_same_values(dtype: str) -> None:
    plain, bits = layout(dtype, False), layout(dtype, True)
    assert bits.array_dtype == ARRAY.get(dtype, dtype)
    assert bits.page_bytes == plain.page_bytes  # the budget counts the same bytes
    k, v = random_kv(8, seed=1)
    slots = jnp.asarray([0, 5, 17, 40, 41, 200, 255, 256], jnp.int32)  # 256: padding
    stored_plain = plain.write(plain.empty(), k, v, slots)
    stored_bits = bits.write(bits.empty(), k, v, slots)
    assert stored_bits.dtype == jnp.dtype(bits.array_dtype)
    as_plain = jax.lax.bitcast_convert_type(stored_bits, jnp.dtype(dtype))
    assert np.array_equal(
        np.asarray(as_plain).view(np.uint8), np.asarray(stored_plain).view(np.uint8)
    )
    for a, b in zip(plain.unpack(stored_plain), bits.unpack(stored_bits), strict=True):
        assert a.dtype == b.dtype
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert np.array_equal(
        np.asarray(plain.decode(stored_plain)), np.asarray(bits.decode(stored_bits))
    )


def attend_once(dtype: str, bits: bool) -> np.ndarray:
    """One jitted write-and-attend step over random pages (the same values either way)."""
    kv = layout(dtype, bits)
    attention = CpuAttention(kv, chunk_size=64, max_prefill_seqs=2)
    attention_batch, slots = batch(kv.num_pages)
    rng = np.random.default_rng(2)
    pages = jnp.asarray(rng.standard_normal(kv.shape), jnp.float32).astype(dtype)
    if bits:
        pages = jax.lax.bitcast_convert_type(pages, jnp.dtype(kv.array_dtype))
    k, v = random_kv(8, seed=3)
    q = jnp.asarray(rng.standard_normal((8, KV_HEADS * GROUPS, DIM)), jnp.bfloat16)

    @jax.jit
    def step(pages: jax.Array) -> jax.Array:
        pages = attention.write(pages, k, v, slots)
        return attention.attend(q, pages, attention_batch)

    return np.asarray(step(pages).astype(jnp.float32))


@pytest.mark.parametrize("dtype", ("bfloat16", "float8_e4m3fn"))
def test_cpu_attention_over_bits_gives_the_same_output_bits(dtype: str) -> None:
    plain, bits = attend_once(dtype, False), attend_once(dtype, True)
    assert np.isfinite(plain).all() and plain.any()
    assert np.array_equal(plain, bits)


def whole_cache_floats(dtype: str, bits: bool) -> set[str]:
    """Float arrays in a compiled write-and-attend step at least the size of the cache."""
    kv = layout(dtype, bits, num_pages=2048)
    attention = CpuAttention(kv, chunk_size=64, max_prefill_seqs=2)
    attention_batch, _ = batch(kv.num_pages)

    def step(pages: jax.Array, k: jax.Array, v: jax.Array, q: jax.Array, slots: jax.Array):  # type: ignore[no-untyped-def]
        pages = attention.write(pages, k, v, slots)
        return attention.attend(q, pages, attention_batch), pages

    shapes = (
        jax.ShapeDtypeStruct(kv.shape, kv.array_dtype),
        jax.ShapeDtypeStruct((8, KV_HEADS, DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, KV_HEADS, DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, KV_HEADS * GROUPS, DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )
    text = jax.jit(step, donate_argnums=0).lower(*shapes).compile().as_text()
    whole = math.prod(kv.shape)
    found = set()
    for kind, dims in re.findall(r"\b(\w+)\[([\d,]+)\]", text):
        if kind in FLOATS and math.prod(int(d) for d in dims.split(",")) >= whole:
            found.add(f"{kind}[{dims}]")
    return found


@pytest.mark.parametrize("dtype", ("bfloat16", "float8_e5m2"))
def test_a_step_over_bits_pages_holds_no_whole_cache_of_floats(dtype: str) -> None:
    assert whole_cache_floats(dtype, bits=True) == set()
    # the control: kept as floats, XLA:CPU writes and reads through a whole-cache array
    # (if this fails, a later XLA no longer does, and `bits` may be dropped)
    assert whole_cache_floats(dtype, bits=False)
