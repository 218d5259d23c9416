"""engine.attention.gpu: the Pallas kernel (Pallas' interpreter on CPU) and the XLA form
over head-major pages against ReferenceAttention over the same K/V in interleaved pages.

Batches are built by engine.paged_model.make_batch on scattered pages holding random K/V
everywhere, so a position a query must not see (past its sequence, past the causal edge,
outside the window, on page 0 where a table's unused entries point) would change its
output. Lengths cross page boundaries (15, 16, 17, 33 positions at pages of 16); buckets
hold padding queries and padding sequences; decode rows' pages are split among programs
(8 sequences x 2 kv heads: 8 splits) and, in one test, not. Tolerances: float32 2e-5; bfloat16 3e-2
(inputs in bfloat16; the kernel normalizes after the value product, the reference
before it, so their bfloat16 probabilities round differently); fp8 pages as bfloat16.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.attention import (
    AttentionBatch,
    KVLayout,
    ReferenceAttention,
    attention_backend,
    attention_layout,
)
from engine.attention.gpu import GpuAttention
from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.mesh import default_mesh
from engine.paged_model import Chunk, forward, make_batch, stack_layers

PAGE = 16
PAGES_PER_SEQ = 6
NUM_PAGES = 40
TOL = {"float32": 2e-5, "bfloat16": 3e-2}
Span = tuple[int, int]  # (first position of the step's queries, how many)

DECODE_ONLY = [(14, 1), (15, 1), (16, 1), (32, 1), (0, 1), (80, 1)]  # 15, 16, 17, 33, 1, 81
PROMPT_ONLY = [(0, 33), (16, 17), (40, 5)]  # from 0, from a page edge, mid-page
MIXED = [(16, 1), (5, 1), (0, 20), (32, 1), (17, 31)]  # a decode row after a chunk too


@dataclass(frozen=True)
class Config:
    kv_heads: int
    groups: int  # query heads per kv head
    head_dim: int
    dtype: str = "float32"
    window: int | None = None
    pages: str = "auto"  # the pages' dtype: the model's, or an fp8 one
    max_splits: int = 8  # decode rows' pages among up to this many programs

    @property
    def page_dtype(self) -> str:
        return self.dtype if self.pages == "auto" else self.pages


def interleaved(config: Config) -> KVLayout:
    return KVLayout(NUM_PAGES, PAGE, config.kv_heads, config.head_dim, config.page_dtype)


@functools.cache
def jitted(config: Config, kernel: str, mesh_size: int = 1):  # type: ignore[no-untyped-def]
    layout = attention_layout(interleaved(config), "gpu")
    mesh = default_mesh(mesh_size) if mesh_size > 1 else None
    attention = GpuAttention(
        layout, mesh, kernel=kernel, interpret=True, max_splits=config.max_splits
    )
    return jax.jit(functools.partial(attention.attend, sliding_window=config.window))


@functools.cache
def reference(config: Config):  # type: ignore[no-untyped-def]
    attention = ReferenceAttention(interleaved(config))
    return jax.jit(functools.partial(attention.attend, sliding_window=config.window))


def build(
    config: Config, spans: Sequence[Span], *, tokens: int = 64, seqs: int = 8, seed: int = 0
) -> tuple[jax.Array, np.ndarray, AttentionBatch, int]:
    """Queries, interleaved pages (float32 values) and the batch; and how many queries are
    real."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, NUM_PAGES))  # page 0: where unused entries point
    chunks, at = [], 0
    for start, n in spans:
        count = -(-(start + n) // PAGE)
        chunks.append(Chunk([0] * n, start, order[at : at + count].tolist()))
        at += count
    step = make_batch(
        chunks,
        tokens=tokens,
        seqs=seqs,
        pages_per_seq=PAGES_PER_SEQ,
        page_size=PAGE,
        num_pages=NUM_PAGES,
    )
    pages = rng.standard_normal(interleaved(config).shape).astype(np.float32)
    heads = config.kv_heads * config.groups
    q = rng.standard_normal((tokens, heads, config.head_dim)).astype(np.float32)
    return jnp.asarray(q, config.dtype), pages, step.attention, sum(n for _, n in spans)


def compare(config: Config, spans: Sequence[Span], kernel: str = "pallas", **shape: int) -> None:
    q, pages, batch, real = build(config, spans, **shape)
    flat = jnp.asarray(pages, config.page_dtype)  # the same stored values for both
    want = np.asarray(reference(config)(q, flat, batch).astype(jnp.float32))
    head_major = flat.transpose(2, 0, 1, 3)  # [num_pages, page, 2 kv, d] -> [2 kv, pages, ...]
    got = np.asarray(jitted(config, kernel)(q, head_major, batch).astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = TOL[config.dtype]
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=0)
    assert not got[real:].any()  # padding queries attend to nothing
    assert np.abs(want[:real]).max() > 0.1  # the outputs compared are not all zeros


F32 = Config(2, 3, 32)  # 3 query heads a kv head: padded to 4 rows of a block
BF16 = Config(2, 4, 32, "bfloat16")
BATCHES = {"decode": DECODE_ONLY, "prompt": PROMPT_ONLY, "mixed": MIXED}


@pytest.mark.parametrize("config", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_kernel_matches_the_reference(config: Config, name: str) -> None:
    compare(config, BATCHES[name])


def test_kernel_sliding_window_and_one_kv_head() -> None:
    config = Config(1, 8, 64, window=20)
    compare(config, MIXED)
    compare(config, DECODE_ONLY, seed=1)


def test_kernel_without_splits() -> None:
    """8 sequences x 2 kv heads split 8 ways elsewhere here; one program a row too."""
    compare(replace(F32, max_splits=1), MIXED)
    compare(replace(BF16, max_splits=1, window=24), DECODE_ONLY)


def test_kernel_fp8_pages() -> None:
    compare(Config(2, 2, 32, "bfloat16", pages="float8_e4m3fn"), MIXED)


def test_kernel_small_bucket_and_padding_sequences() -> None:
    """A bucket of fewer tokens than a chunk block, sequences past num_seqs."""
    compare(F32, [(20, 1), (0, 3)], tokens=8, seqs=4)


@pytest.mark.parametrize("config", [F32, BF16, Config(1, 8, 64, window=20)], ids=str)
def test_xla_form_matches_the_reference(config: Config) -> None:
    compare(config, MIXED, kernel="xla")


def test_tensor_parallel_splits_kv_heads() -> None:
    """Each of 2 devices attends over, and writes, its own kv head's pages."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py asks XLA:CPU for 4)")
    config = Config(2, 2, 32)
    q, pages, batch, real = build(config, MIXED)
    flat = jnp.asarray(pages)
    want = np.asarray(reference(config)(q, flat, batch))
    got = np.asarray(jitted(config, "pallas", 2)(q, flat.transpose(2, 0, 1, 3), batch))
    np.testing.assert_allclose(got[:real], want[:real], atol=TOL["float32"], rtol=0)
    layout = attention_layout(interleaved(config), "gpu")
    k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal((3, 2, 32)), jnp.float32)
        for i in (1, 2)
    )
    slots = jnp.asarray([5, 40, 17], jnp.int32)
    split = GpuAttention(layout, default_mesh(2)).write(layout.empty(), k, v, slots)
    np.testing.assert_array_equal(
        np.asarray(split), np.asarray(GpuAttention(layout).write(layout.empty(), k, v, slots))
    )


def test_write_puts_each_token_in_its_heads_rows() -> None:
    """GpuAttention.write on head-major pages stores what the interleaved write stores."""
    base = KVLayout(4, 4, 2, 8)
    layout = attention_layout(base, "gpu")
    assert layout.shape == (4, 4, 4, 8) and layout.head_axis == 0 and layout.page_axis == 1
    assert layout.page_bytes == base.page_bytes and layout.page_shape == (4, 4, 8)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32) for _ in range(2))
    slots = jnp.asarray([5, 0, 16], jnp.int32)  # the last is padding: past the pages
    got = GpuAttention(layout).write(layout.empty(), k, v, slots)
    want = base.write(base.empty(), k, v, slots)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).transpose(2, 0, 1, 3))
    assert np.asarray(got).any()


def test_take_and_put_move_whole_pages_on_either_layout() -> None:
    for layout in (KVLayout(4, 2, 1, 4), KVLayout(4, 2, 1, 4, head_major=True)):
        pages = jnp.arange(np.prod(layout.shape), dtype=jnp.float32).reshape(layout.shape)
        block = layout.take(pages, jnp.asarray([3, 1]))
        moved = layout.put(layout.empty(), jnp.asarray([0, 4]), block)  # 4: past the end
        again = layout.take(moved, jnp.asarray([0]))
        np.testing.assert_array_equal(
            np.asarray(again), np.asarray(layout.take(pages, jnp.asarray([3])))
        )
        assert not np.asarray(layout.take(moved, jnp.asarray([1, 2, 3]))).any()


def test_the_backend_choice() -> None:
    base = KVLayout(8, PAGE, 2, 32)
    gpu = attention_layout(base, "gpu")
    assert isinstance(attention_backend("gpu", gpu), GpuAttention)
    assert attention_backend("gpu", gpu, choice="gpu-xla").kernel == "xla"  # type: ignore[attr-defined]
    assert attention_layout(base, "gpu", "reference") == base
    assert isinstance(attention_backend("gpu", base, choice="reference"), ReferenceAttention)
    assert isinstance(attention_backend("cpu", base, choice="reference"), ReferenceAttention)
    assert attention_layout(base, "cpu") == base and attention_layout(base, "tpu") == base
    with pytest.raises(ValueError, match="GPU only"):
        attention_backend("cpu", base, choice="gpu-pallas")
    with pytest.raises(ValueError, match="must be one of"):
        attention_layout(base, "gpu", "flash")
    with pytest.raises(ValueError, match="head-major"):
        GpuAttention(base)
    with pytest.raises(ValueError, match="int8 is not supported on GPU"):
        GpuAttention(replace(gpu, dtype="int8"))


def test_the_model_through_the_seam_matches_the_reference(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    """engine.paged_model's forward, unchanged, over head-major pages through GpuAttention:
    the same hidden states as over interleaved pages through the reference, and the same
    K/V written, over a prompt chunk beside a decode row and then the reverse."""
    folder = tiny_checkpoint_of("llama")
    cfg = load_model_config(folder)
    params = stack_layers(load_params(folder, cfg, "float32"))
    base = KVLayout(16, 8, cfg.num_kv_heads, cfg.head_dim)
    layers = cfg.num_layers
    a, b = list(range(3, 24)), list(range(40, 52))
    a_pages, b_pages = [9, 2, 14], [0, 11]
    steps = [
        [Chunk(a[:20], 0, a_pages), Chunk(b[:5], 0, b_pages)],
        [Chunk(a[20:21], 20, a_pages), Chunk(b[5:12], 5, b_pages)],
    ]
    inv_freq = cfg.rope_inv_freq()
    outputs = []
    for attention in (
        ReferenceAttention(base.stacked(layers)),
        GpuAttention(attention_layout(base, "gpu").stacked(layers), interpret=True),
    ):
        step = jax.jit(functools.partial(forward, cfg=cfg, attention=attention))
        pages = attention.layout.empty()  # every layer's
        hidden = []
        for chunks in steps:
            batch = make_batch(
                chunks, tokens=32, seqs=4, pages_per_seq=4, page_size=8, num_pages=16
            )
            x, pages = step(params, pages, batch, inv_freq)
            hidden.append(np.asarray(x[:28]))
        outputs.append((hidden, np.asarray(pages)))
    (want, want_pages), (got, got_pages) = outputs
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    # layer 0's K/V (its pages first) come from the embeddings alone: the same bits; later
    # layers' from hidden states that differ in the last float32 places
    want_pages = want_pages.transpose(2, 0, 1, 3)  # interleaved -> head-major
    np.testing.assert_array_equal(got_pages[:, :16], want_pages[:, :16])
    np.testing.assert_allclose(got_pages, want_pages, atol=1e-5, rtol=1e-5)


LOWERINGS = {
    "8b heads, bfloat16, pages of 16": (Config(8, 4, 128, "bfloat16"), 16, 64, 8),
    "1b heads, pages of 128, 256 rows": (Config(8, 4, 64, "bfloat16"), 128, 256, 256),
    "fp8 pages, a window": (Config(2, 2, 32, "bfloat16", 24, "float8_e4m3fn"), 16, 32, 4),
    "float32, 3 groups": (Config(2, 3, 32), 16, 32, 4),
}


@pytest.mark.parametrize("name", sorted(LOWERINGS))
def test_the_kernel_lowers_to_triton_for_cuda(name: str) -> None:
    """No GPU here, but Pallas' Triton lowering runs in Python: lowering for CUDA builds
    both calls' Triton modules (each load, product and loop the kernel uses, at these
    shapes) and fails on anything Triton cannot take. What XLA then compiles of them
    (Triton to PTX) waits for a GPU (bench.gpu_check)."""
    config, page, tokens, seqs = LOWERINGS[name]
    layout = attention_layout(
        KVLayout(37, page, config.kv_heads, config.head_dim, config.page_dtype), "gpu"
    )
    attention = GpuAttention(layout)
    heads = config.kv_heads * config.groups
    spec = jax.ShapeDtypeStruct
    batch = AttentionBatch(
        spec((seqs,), jnp.int32), spec((seqs, 9), jnp.int32),
        spec((seqs + 1,), jnp.int32), spec((1,), jnp.int32),
    )  # fmt: skip
    q = spec((tokens, heads, config.head_dim), jnp.dtype(config.dtype))
    attend = functools.partial(attention.attend, sliding_window=config.window)
    lowered = jax.jit(attend).trace(q, spec(layout.shape, layout.dtype), batch)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # decode rows, prompt chunks
