"""engine.attention: the page layout, the reference ragged paged attention, and the TPU
backend's folding and sharding around the Pallas kernel.

The Pallas kernel itself cannot run here: Pallas' interpret modes in jax 0.10.2 fail on
its reshaped and strided VMEM reads. The kernel's own reference (same module, same
arguments) stands in for it, so these tests check that our layout, head folding,
split of decode rows from prompt chunks and per-device split give the reference's
answer; tests/bench/test_tpu_aot.py compiles the kernel itself for TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.sharding import Mesh

from engine.attention import AttentionBatch, KVLayout, ReferenceAttention
from engine.attention.tpu import (
    DECODE_QUERIES_PER_BLOCK,
    KernelCall,
    PallasAttention,
    fold_queries,
    kernel_calls,
    queries_per_block,
    unfold_outputs,
)

PAGE, PAGES = 16, 12


def kernel_reference(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):  # type: ignore[no-untyped-def]
    """jax's reference of the kernel at the call's own queries (cu_q_lens[0] onwards: a
    call may start past the batch's first query), NaN at every other row (the kernel
    leaves them undefined). Run on the host, so it can be traced."""

    def host(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs):  # type: ignore[no-untyped-def]
        first, count = int(cu_q_lens[0]), int(num_seqs[0])
        out = np.full(q.shape, np.nan, q.dtype)
        if count:
            got = rpa.ref_ragged_paged_attention(
                jnp.asarray(q[first:]), jnp.asarray(pages), jnp.asarray(kv_lens),
                jnp.asarray(page_indices), jnp.asarray(cu_q_lens - first), jnp.asarray(num_seqs),
                sm_scale=options["sm_scale"], sliding_window=options["sliding_window"],
            )  # fmt: skip
            out[first : first + got.shape[0]] = np.asarray(got)
        return out

    CALLS.append(options)
    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.pure_callback(host, shape, q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)


CALLS: list[dict] = []  # kernel_reference's options, as each call is traced


def traceable_kernel(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):  # type: ignore[no-untyped-def]
    """The kernel's contract computed by ReferenceAttention on its unfolded view (jax's
    reference loops in Python over num_seqs, which shard_map traces)."""
    pages_count, page, combined, lanes = pages.shape
    layout = KVLayout(pages_count, page, combined // 2, lanes)
    scaled = q * (options["sm_scale"] * lanes**0.5)  # the reference scales by lanes**-0.5
    batch = AttentionBatch(kv_lens, page_indices, cu_q_lens, num_seqs)
    return ReferenceAttention(layout).attend(
        scaled, pages, batch, sliding_window=options["sliding_window"]
    )


def ragged_case(kv_heads: int, head_dim: int, heads: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A decode row (20 positions), a chunk of 5 on top of 32, a fresh 9-token prompt,
    padding to 16 queries, with every position's K/V written at scattered pages."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array([20, 37, 9, 0], np.int32)
    cu = np.array([0, 1, 6, 15, 15], np.int32)
    table = np.zeros((4, 4), np.int32)
    table[0, :2], table[1, :3], table[2, :1] = [3, 7], [0, 5, 9], [11]
    k = rng.standard_normal((PAGES * PAGE, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((PAGES * PAGE, kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((16, heads, head_dim)).astype(np.float32)
    batch = AttentionBatch(
        jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu), jnp.array([3], jnp.int32)
    )
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), batch


def test_pages_round_trip_and_padding_writes_nothing() -> None:
    layout = KVLayout(PAGES, PAGE, kv_heads=4, head_dim=8, fold=2)
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    slots = jnp.array([5 * PAGE + 2, PAGES * PAGE, 0], jnp.int32)  # the second: padding
    pages = layout.write(layout.empty(), k, v, slots)
    keys, values = layout.unpack(pages)
    np.testing.assert_array_equal(keys[5, 2], k[0])
    np.testing.assert_array_equal(values[0, 0], v[2])
    written = np.argwhere(np.asarray(pages != 0).any(axis=(2, 3)))
    assert sorted(map(tuple, written)) == [(0, 0), (5, 2)]


@pytest.mark.parametrize(("head_dim", "fold"), [(32, 1), (64, 2)])
@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_the_kernels_reference(
    head_dim: int, fold: int, window: int | None
) -> None:
    kv_heads, heads = 2, 8
    q, k, v, batch = ragged_case(kv_heads, head_dim, heads)
    slots = jnp.arange(PAGES * PAGE, dtype=jnp.int32)
    reference = ReferenceAttention(KVLayout(PAGES, PAGE, kv_heads, head_dim))
    want = reference.attend(
        q, reference.write(reference.layout.empty(), k, v, slots), batch, sliding_window=window
    )
    tpu = PallasAttention(
        KVLayout(PAGES, PAGE, kv_heads, head_dim, fold=fold), kernel=kernel_reference
    )
    got = tpu.attend(q, tpu.write(tpu.layout.empty(), k, v, slots), batch, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got[:15]), np.asarray(want[:15]), atol=2e-6)
    assert np.all(np.asarray(want[15:]) == 0)  # padding queries attend to nothing
    # each query saw its own sequence only: a changed key of sequence 0 (its last
    # position, 19: page 7, offset 3) moves no other row
    other = k.at[7 * PAGE + 3].add(100.0)
    moved = reference.attend(
        q,
        reference.write(reference.layout.empty(), other, v, slots),
        batch,
        sliding_window=window,
    )
    changed = np.flatnonzero(np.abs(np.asarray(moved - want)).max(axis=(1, 2)) > 0)
    assert changed.tolist() == [0]


def batch_of(kv_lens: list[int], q_lens: list[int], seqs: int = 6) -> AttentionBatch:
    """Sequences in turn over pages 0, 1, ... (each its own), padded to `seqs`."""
    table = np.zeros((seqs, 4), np.int32)
    page = 0
    for i, kv in enumerate(kv_lens):
        count = -(-kv // PAGE)
        table[i, :count] = np.arange(page, page + count)
        page += count
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.pad(cu, (0, seqs + 1 - cu.shape[0]), mode="edge")
    kv = np.pad(np.asarray(kv_lens, np.int32), (0, seqs - len(kv_lens)))
    return AttentionBatch(
        jnp.asarray(kv), jnp.asarray(table), jnp.asarray(cu), jnp.array([len(kv_lens)], jnp.int32)
    )


@pytest.mark.parametrize(
    ("kv_lens", "q_lens"),
    [
        ([9, 30, 17, 2], [1, 1, 1, 1]),  # decode rows only: one call
        ([12, 7], [12, 7]),  # prompts only: one call
        ([9, 30, 20, 5], [1, 1, 6, 1]),  # a row after a chunk goes with the chunks
    ],
)
def test_decode_rows_and_chunks_each_match_the_reference(
    kv_lens: list[int], q_lens: list[int]
) -> None:
    kv_heads, heads, head_dim, tokens = 2, 8, 64, 24
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.standard_normal((PAGES * PAGE, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((PAGES * PAGE, kv_heads, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), jnp.float32)
    batch = batch_of(kv_lens, q_lens)
    slots = jnp.arange(PAGES * PAGE, dtype=jnp.int32)
    reference = ReferenceAttention(KVLayout(PAGES, PAGE, kv_heads, head_dim))
    want = reference.attend(q, reference.write(reference.layout.empty(), k, v, slots), batch)
    tpu = PallasAttention(
        KVLayout(PAGES, PAGE, kv_heads, head_dim, fold=2), kernel=kernel_reference
    )
    got = tpu.attend(q, tpu.write(tpu.layout.empty(), k, v, slots), batch)
    real = sum(q_lens)
    np.testing.assert_allclose(np.asarray(got[:real]), np.asarray(want[:real]), atol=2e-6)


def test_decode_rows_get_blocks_of_their_own_query() -> None:
    """The kernel is called with one-query blocks for the leading decode rows and with
    QUERIES_PER_BLOCK-query blocks for the chunks after them."""
    kv_heads, heads, head_dim, tokens = 2, 8, 64, 24
    q = jnp.zeros((tokens, heads, head_dim), jnp.float32)
    layout = KVLayout(PAGES, PAGE, kv_heads, head_dim, fold=2)
    tpu = PallasAttention(layout, kernel=kernel_reference)
    CALLS.clear()
    tpu.attend(q, layout.empty(), batch_of([9, 30, 20], [1, 1, 6]))
    blocks = {call["num_queries_per_block"] for call in CALLS}  # each traced per branch
    assert blocks == {DECODE_QUERIES_PER_BLOCK, queries_per_block(tokens)}


def test_kernel_calls_keep_each_decode_row_in_its_own_block() -> None:
    """The block rules bench.tpu_aot counts: 64 decode rows read their KV once each (one
    query block per row), beside a chunk that reads its KV once per block of queries."""
    layout = KVLayout(4096, 128, 8, 64, fold=2)
    q_lens, kv_lens = [1] * 64 + [256], [4096] * 64 + [1024]
    decode, chunks = kernel_calls(layout, q_lens, kv_lens, tokens=320, pages_per_seq=32)
    assert decode.queries_per_block == 1 and len(decode.sequences) == 64
    assert decode.blocks(layout.page_size) == [(1, 16)] * 64  # 4096 positions: 16 of 256
    assert chunks.sequences == ((64, 256, 1024),)
    # the chunk starts at query 64 in blocks of 128: blocks 0, 1 and 2 compute it
    assert chunks.blocks(layout.page_size) == [(3, 2)]
    assert kernel_calls(layout, [1] * 4, [10] * 4, 8, 32) == (
        KernelCall(1, 2, ((0, 1, 10), (1, 1, 10), (2, 1, 10), (3, 1, 10))),
    )


def test_folding_keeps_each_head_in_its_own_lanes() -> None:
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, 64)), jnp.float32)
    folded = fold_queries(q, kv_heads=4, fold=2)
    assert folded.shape == (3, 8, 128)
    # heads of kv head 0 (0, 1) in lanes 0-63, of kv head 1 (2, 3) in lanes 64-127
    np.testing.assert_array_equal(folded[:, 2, 64:], q[:, 2])
    assert not np.asarray(folded[:, 2, :64]).any()
    np.testing.assert_array_equal(unfold_outputs(folded, kv_heads=4, fold=2), q)


def test_per_device_split_gives_the_one_device_answer() -> None:
    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    kv_heads, heads, head_dim = 4, 8, 64
    q, k, v, batch = ragged_case(kv_heads, head_dim, heads, seed=3)
    slots = jnp.arange(PAGES * PAGE, dtype=jnp.int32)
    layout = KVLayout(PAGES, PAGE, kv_heads, head_dim, fold=2)
    one = PallasAttention(layout, kernel=kernel_reference)
    two = PallasAttention(layout, Mesh(np.array(devices), ("model",)), kernel=traceable_kernel)
    want = one.attend(q, one.write(layout.empty(), k, v, slots), batch)
    got = jax.jit(functools.partial(two.attend, batch=batch))(
        q, two.write(layout.empty(), k, v, slots)
    )
    np.testing.assert_allclose(np.asarray(got[:15]), np.asarray(want[:15]), atol=2e-6)
