"""engine.model.project, every layer's product: rows x w^T summed in float32 matches a
float64 product, and a row gets the same bits at every row count a step can take (from
engine.core.runner's smallest buckets up), in float32 and bfloat16. The second is what
makes a sequence's tokens the same alone and in a full batch; it is a property of the
backend's kernels, checked here on the machine that runs the suite. The same for
engine.row_dot's kernel (ModelConfig.row_products, XLA:CPU's product in the engine),
from one row up."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from engine import row_dot
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


# engine.row_dot's kernel: shapes with a K tail (not a multiple of 8 lanes) and weight
# rows that fill no block or task evenly, besides the model's
KERNEL_SHAPES = [(64, 64), (576, 960), (1536, 576), (60, 50), (13, 7)]


def test_the_kernel_builds_here() -> None:
    """The suite's machines have a C++ compiler and jaxlib's FFI headers: the kernel the
    CPU engine serves with is the one the tests below check."""
    assert row_dot.available()


@pytest.mark.parametrize(("inner", "outer"), KERNEL_SHAPES)
def test_the_kernel_matches_float64(inner: int, outer: int) -> None:
    rng = np.random.default_rng(inner * outer)
    x = rng.standard_normal((37, inner)).astype(np.float32)
    w = rng.standard_normal((outer, inner)).astype(np.float32)
    got = np.asarray(jax.jit(functools.partial(project, kernel=True))(x, w), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.sqrt(inner) / 8), rtol=1e-5)


@pytest.mark.parametrize(("inner", "outer"), KERNEL_SHAPES)
def test_the_kernel_gives_a_row_the_same_bits_at_every_row_count(inner: int, outer: int) -> None:
    """From one row up, odd counts included (blocks of 4 rows, tails of 1): XLA's own
    product gives one row other bits than two (test above), the kernel does not."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((300, inner)).astype(np.float32)
    w = rng.standard_normal((outer, inner)).astype(np.float32)
    product = jax.jit(functools.partial(project, kernel=True))
    widest = np.asarray(product(x, w))
    for rows in (1, 2, 3, 5, 8, 13, 32, 100, 256):
        assert np.array_equal(np.asarray(product(x[:rows], w)), widest[:rows]), rows
    # and a row's bits do not depend on its neighbours' values
    other = x.copy()
    other[1:] = rng.standard_normal(other[1:].shape).astype(np.float32)
    assert np.array_equal(np.asarray(product(other, w))[0], widest[0])


def test_the_kernel_skips_padding_rows() -> None:
    """`live`: rows from it on are a step's padding, zeros; the live rows keep their bits
    (the stacked form reads a layer in place, as the engine calls it)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    stack = rng.standard_normal((2, 96, 576)).astype(np.float32)
    layer = np.int32(1)
    whole = np.asarray(jax.jit(row_dot.row_dot)(x, stack, layer))
    np.testing.assert_allclose(whole, x @ stack[1].T, rtol=1e-4, atol=1e-3)
    for live in (0, 1, 13, 40):
        got = np.asarray(jax.jit(row_dot.row_dot)(x, stack, layer, np.int32(live)))
        assert np.array_equal(got[:live], whole[:live]), live
        assert not got[live:].any(), live


@pytest.mark.parametrize(("inner", "outer"), KERNEL_SHAPES)
def test_the_bfloat16_kernel_matches_float64_with_a_rows_bits_at_every_count(
    inner: int, outer: int
) -> None:
    """bfloat16 rows and weights, summed in float32: AVX512-BF16's pair products where the
    processor has them, their emulation elsewhere (this calls the kernel either way).
    K from 7 to 1536: tails of pairs and odd counts. Padding rows are zeros."""
    rng = np.random.default_rng(inner + 3 * outer)
    x = rng.standard_normal((300, inner)).astype("bfloat16")
    w = rng.standard_normal((outer, inner)).astype("bfloat16")
    product = jax.jit(row_dot.row_dot)
    widest = np.asarray(product(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64).T  # the products are exact
    np.testing.assert_allclose(widest, want, atol=1e-5 * max(1.0, np.sqrt(inner)), rtol=1e-5)
    for rows in (1, 2, 3, 5, 8, 9, 13, 32, 100, 256):
        assert np.array_equal(np.asarray(product(x[:rows], w)), widest[:rows]), rows
    padded = np.asarray(product(x[:16], w, live=np.int32(5)))
    assert np.array_equal(padded[:5], widest[:5]) and not padded[5:].any()


def test_bfloat16_products_take_the_kernel_where_it_is_native() -> None:
    """`project` sends bfloat16 through the kernel where the processor has AVX512-BF16
    (XLA's product gives a row other bits at one row than at many), else XLA's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 576)).astype("bfloat16")
    w = rng.standard_normal((960, 576)).astype("bfloat16")
    product = jax.jit(functools.partial(project, kernel=True))
    got = np.asarray(product(x, w).astype(np.float32))
    if row_dot.bf16_native():
        want = np.asarray(row_dot.row_dot(x, w).astype("bfloat16").astype(np.float32))
        assert np.array_equal(got, want)
        assert np.array_equal(np.asarray(product(x[:1], w).astype(np.float32)), got[:1])
    else:
        assert np.array_equal(got, np.asarray(jax.jit(project)(x, w).astype(np.float32)))


PACKED_SHAPES = [(2, 16), (3, 32), (64, 48), (100, 80), (576, 960), (1536, 576)]  # (K, N)


@pytest.mark.parametrize(("inner", "outer"), PACKED_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_match_float64_with_a_rows_bits_at_every_count(
    inner: int, outer: int, dtype: str
) -> None:
    """A stack packed for broadcast rows (row_dot.pack): each layer read in place matches
    float64, a row has the same bits at every row count (8-, 4- and 1-row passes and
    their mixes) and padding rows are zeros. float32 is each output's chain of fused
    multiply-adds in k order from zero, bit for bit; bfloat16 runs on the processor's dot
    products or their emulation."""
    if dtype == "bfloat16" and inner % 2:
        pytest.skip("bfloat16 packs K in pairs")
    rng = np.random.default_rng(inner + 5 * outer)
    x = rng.standard_normal((300, inner)).astype(dtype)
    stack = rng.standard_normal((2, outer, inner)).astype(dtype)
    packed = row_dot.pack(jax.numpy.asarray(stack))
    per = 1 if dtype == "float32" else 2
    assert packed.shape == (2, outer // 16, inner // per, 16 * per)
    product = jax.jit(row_dot.row_dot)
    for layer in range(2):
        index = np.int32(layer)
        widest = np.asarray(product(x, packed, index))
        want = x.astype(np.float64) @ stack[layer].astype(np.float64).T  # exact products
        np.testing.assert_allclose(widest, want, atol=1e-5 * max(1.0, np.sqrt(inner)), rtol=1e-5)
        for rows in (1, 3, 4, 5, 8, 9, 13, 100):
            assert np.array_equal(np.asarray(product(x[:rows], packed, index)), widest[:rows])
        padded = np.asarray(product(x[:16], packed, index, np.int32(5)))
        assert np.array_equal(padded[:5], widest[:5]) and not padded[5:].any()
    if dtype == "float32":  # fma(x, w, acc): the exact product and sum, rounded once
        acc = np.zeros((5, outer), np.float32)
        for k in range(inner):
            exact = x[:5, k : k + 1].astype(np.float64) * stack[1][:, k].astype(np.float64)
            acc = (acc + exact).astype(np.float32)
        assert np.array_equal(acc, widest[:5])


def test_packs_takes_float32_and_native_bfloat16_stacks_in_whole_vectors() -> None:
    """Packed weights take 16 outputs to a vector; bfloat16 needs the processor's pair
    products (else XLA's bfloat16 product serves) and K in pairs; other weights keep the
    lane form."""
    stack = jax.numpy.zeros((2, 32, 64), "bfloat16")
    assert row_dot.packs(stack) == row_dot.bf16_native()
    assert row_dot.packs(stack.astype("float32")) == row_dot.available()
    assert row_dot.packs(jax.numpy.zeros((2, 32, 63), "float32")) == row_dot.available()
    assert not row_dot.packs(jax.numpy.zeros((2, 40, 64), "bfloat16"))  # 40 % 16
    assert not row_dot.packs(jax.numpy.zeros((2, 40, 64), "float32"))
    assert not row_dot.packs(jax.numpy.zeros((2, 32, 63), "bfloat16"))  # odd K
    assert not row_dot.packs(stack[0])  # a stack's layers, read with their index
    assert not row_dot.packs(jax.numpy.zeros((2, 32, 64), "float16"))
    with pytest.raises(TypeError, match="layer index"):
        row_dot.row_dot(jax.numpy.zeros((1, 64), "bfloat16"), row_dot.pack(stack))


def test_a_failed_build_says_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        row_dot.build(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_the_shared_header_names_the_library(tmp_path, monkeypatch) -> None:
    """Both kernels include engine/cpu_kernel.h: an edited header must build a new
    library, never load one built from the old header."""
    before = row_dot._library_path(tmp_path, row_dot.SOURCE)
    header = tmp_path / "cpu_kernel.h"
    header.write_bytes(row_dot.HEADER.read_bytes() + b"// edited\n")
    monkeypatch.setattr(row_dot, "HEADER", header)
    assert row_dot._library_path(tmp_path, row_dot.SOURCE) != before


def test_a_layer_of_a_stack_is_read_in_place_with_the_same_bits() -> None:
    """engine.paged_model hands the kernel every layer's weights and the layer's index
    (a slice would be copied out of the stack first): the same bits as the slice alone,
    through the kernel and, for other dtypes, through XLA's product."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    stack = rng.standard_normal((3, 40, 64)).astype(np.float32)
    for kernel in (True, False):
        product = jax.jit(functools.partial(project, kernel=kernel))
        for layer in range(3):
            got = product(x, stack, layer=np.int32(layer))
            assert np.array_equal(np.asarray(got), np.asarray(product(x, stack[layer]))), layer


EMULATED = """
import sys
import jax, numpy as np
from engine import row_dot
row_dot.FLAGS += ("-mno-avx512f",)  # the build a processor without AVX-512 gets
assert row_dot.available()
x32, w32 = np.load(sys.argv[1])["x"], np.load(sys.argv[1])["w"]
x, w = x32.astype("bfloat16"), w32.astype("bfloat16")
product = jax.jit(row_dot.row_dot)
out = [np.asarray(product(x[:m], w)) for m in (1, 9, len(x))]
packed = row_dot.pack(jax.numpy.asarray(w[:48])[None])
at = [np.asarray(product(x[:m], packed, np.int32(0))) for m in (1, 9, len(x))]
np.savez(
    sys.argv[2], native=np.asarray(row_dot.bf16_native()), one=out[0], nine=out[1], all=out[2],
    packed_one=at[0], packed_nine=at[1], packed_all=at[2], f32=np.asarray(product(x32, w32)),
    f32_packed=np.asarray(product(x32, row_dot.pack(jax.numpy.asarray(w32[:48])[None]), 0)),
)
"""


def test_without_avx512_bfloat16_is_emulated_and_float32_keeps_its_bits(tmp_path) -> None:
    """Where the processor lacks AVX-512 (so AVX512-BF16) the kernel emulates bfloat16's
    pair products: built here that way (in a process of its own: one library per
    process), it matches float64 and gives a row the same bits at any row count. Its
    float32 forms, lane and packed, give the bits this process's build gives."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    x = rng.standard_normal((20, 100)).astype(np.float32)
    w = rng.standard_normal((50, 100)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, w=w)
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, "-c", EMULATED, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")]
    subprocess.run(command, env=env, check=True, timeout=600)
    got = np.load(tmp_path / "out.npz")
    assert not got["native"]
    xb = x.astype("bfloat16").astype(np.float64)
    want = xb @ w.astype("bfloat16").astype(np.float64).T
    np.testing.assert_allclose(got["all"], want, atol=1e-4, rtol=1e-5)
    assert np.array_equal(got["one"], got["all"][:1]) and np.array_equal(
        got["nine"], got["all"][:9]
    )
    # the packed form's emulation (48 of the weight rows: whole vectors of 16)
    np.testing.assert_allclose(got["packed_all"], want[:, :48], atol=1e-4, rtol=1e-5)
    assert np.array_equal(got["packed_one"], got["packed_all"][:1])
    assert np.array_equal(got["packed_nine"], got["packed_all"][:9])
    # float32: the same fused multiply-adds in the same order, 8 or 16 lanes to a register
    product = jax.jit(row_dot.row_dot)
    assert np.array_equal(got["f32"], np.asarray(product(x, w)))
    packed = row_dot.pack(jax.numpy.asarray(w[:48])[None])
    assert np.array_equal(got["f32_packed"], np.asarray(product(x, packed, np.int32(0))))
