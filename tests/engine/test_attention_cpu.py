"""engine.attention.cpu: CpuAttention against ReferenceAttention on ragged batches, and its
bit-exactness across batches.

Batches are built by engine.paged_model.make_batch, each sequence on scattered pages,
mostly in the scheduler's order (decode rows, then prompt chunks); some put a one-query
sequence after a chunk, which the backend takes as well. Every page holds random K/V,
so a position a query must not see (past its sequence, past the causal edge, outside
the window, on page 0 where a table's unused entries point) would change its output.
One jitted function per configuration and bucket serves all its batches, so the many
batches cost few compilations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.attention import (
    AttentionBatch,
    CpuAttention,
    KVLayout,
    ReferenceAttention,
    attention_backend,
    cpu,
    cpu_kernel,
)
from engine.attention.cpu import online_update
from engine.paged_model import Chunk, make_batch

PAGE = 16
PAGES_PER_SEQ = 8  # max_model_len 128: four decode blocks of 32 positions
MAX_LEN = PAGE * PAGES_PER_SEQ
Span = tuple[int, int]  # (first position of the step's queries, how many)
Attend = Callable[[jax.Array, jax.Array, AttentionBatch], jax.Array]


@dataclass(frozen=True)
class Config:
    kv_heads: int
    groups: int  # query heads per kv head
    head_dim: int
    dtype: str = "float32"
    window: int | None = None
    tile_queries: int = cpu.TILE_QUERIES
    group_rows: int = cpu.GROUP_ROWS
    tile_block_tokens: int = cpu.TILE_BLOCK_TOKENS
    decode_block_tokens: int = cpu.DECODE_BLOCK_TOKENS
    kernel: bool = True  # float32 and bfloat16 rows through engine.attention.cpu_kernel

    @property
    def heads(self) -> int:
        return self.kv_heads * self.groups


CONFIGS = [
    Config(4, 3, 64),  # the 100m model's heads, the default sizes
    Config(4, 2, 32, window=40, group_rows=16, kernel=False),  # 16 rows: jnp.sum varies
    Config(1, 4, 32, dtype="bfloat16"),  # through the kernel, widened as read
    # many tiles, groups and blocks a batch
    Config(4, 3, 64, tile_queries=16, group_rows=4, tile_block_tokens=32),
    Config(2, 4, 64, window=20, tile_queries=16, group_rows=2, tile_block_tokens=16),
    Config(
        2,
        2,
        64,
        "bfloat16",
        24,
        tile_queries=16,
        tile_block_tokens=32,
        decode_block_tokens=16,
        kernel=False,
    ),
]
# XLA's groups in float32 and bfloat16; the kernel in both
BIT_CONFIGS = [
    *CONFIGS[:3],
    Config(2, 4, 64, window=20),
    Config(1, 4, 32, "bfloat16", kernel=False),
]
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def layout_for(config: Config, num_pages: int) -> KVLayout:
    return KVLayout(num_pages, PAGE, config.kv_heads, config.head_dim, config.dtype)


@functools.cache
def jitted(config: Config, backend: str, num_pages: int) -> Attend:
    layout = layout_for(config, num_pages)
    attention: CpuAttention | ReferenceAttention
    if backend == "cpu":
        attention = CpuAttention(
            layout,
            chunk_size=256,
            max_prefill_seqs=4,
            tile_queries=config.tile_queries,
            group_rows=config.group_rows,
            tile_block_tokens=config.tile_block_tokens,
            decode_block_tokens=config.decode_block_tokens,
            kernel=config.kernel,
        )
    else:
        attention = ReferenceAttention(layout)
    return jax.jit(functools.partial(attention.attend, sliding_window=config.window))


@dataclass(frozen=True)
class Case:
    q: jax.Array
    pages: jax.Array
    batch: AttentionBatch
    spans: tuple[Span, ...]
    num_pages: int

    def rows(self, s: int) -> slice:
        """Sequence s's queries in the batch."""
        cu = np.asarray(self.batch.cu_q_lens)
        return slice(int(cu[s]), int(cu[s + 1]))


def build(
    config: Config,
    spans: Sequence[Span],
    *,
    tokens: int,
    seqs: int,
    seed: int = 0,
    fixed: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    num_pages: int = 8 * PAGES_PER_SEQ + 1,
    pages_per_seq: int = PAGES_PER_SEQ,
) -> Case:
    """Random pages and queries for these sequences (in this order) in a (tokens, seqs)
    bucket. `fixed` maps a sequence to its own queries and K/V (n, heads, dim) and
    (len, 2 * kv_heads, dim), written at its pages whatever else the batch holds."""
    rng = np.random.default_rng(seed)
    layout = layout_for(config, num_pages)
    order = rng.permutation(num_pages)
    chunks, at = [], 0
    for start, n in spans:
        count = -(-(start + n) // PAGE)
        chunks.append(Chunk([0] * n, start, order[at : at + count].tolist()))
        at += count
    step = make_batch(
        chunks,
        tokens=tokens,
        seqs=seqs,
        pages_per_seq=pages_per_seq,
        page_size=PAGE,
        num_pages=num_pages,
    )
    pages = rng.standard_normal(layout.shape).astype(np.float32)
    q = rng.standard_normal((tokens, config.heads, config.head_dim)).astype(np.float32)
    cu = np.asarray(step.attention.cu_q_lens)
    for s, (own_q, own_kv) in (fixed or {}).items():
        q[cu[s] : cu[s + 1]] = own_q
        positions = np.arange(own_kv.shape[0])
        table = np.asarray(chunks[s].pages)
        pages[table[positions // PAGE], positions % PAGE] = own_kv
    dtype = jnp.dtype(config.dtype)
    return Case(
        jnp.asarray(q, dtype), jnp.asarray(pages, dtype), step.attention, tuple(spans), num_pages
    )


def attend(config: Config, case: Case, backend: str = "cpu") -> np.ndarray:
    out = jitted(config, backend, case.num_pages)(case.q, case.pages, case.batch)
    return np.asarray(out.astype(jnp.float32))


def check_against_reference(config: Config, case: Case) -> None:
    got, want = attend(config, case), attend(config, case, "reference")
    real = int(np.asarray(case.batch.cu_q_lens)[len(case.spans)])
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:real], want[:real], atol=TOL[config.dtype], rtol=0)
    assert not got[real:].any()  # padding queries attend to nothing


@st.composite
def ragged_spans(draw: st.DrawFn, tokens: int = 64, seqs: int = 8) -> list[Span]:
    """Decode rows (one query at the end of 1..MAX_LEN positions), then up to three
    prompt chunks (from 0 or mid-sequence, 1 query or many), within the bucket."""
    decode = draw(st.lists(st.integers(1, MAX_LEN), max_size=min(seqs, 7)))
    spans: list[Span] = [(length - 1, 1) for length in decode]
    used = len(spans)
    for _ in range(draw(st.integers(0, 3))):
        if len(spans) == seqs or used == tokens:
            break
        start = draw(st.sampled_from([0, draw(st.integers(0, MAX_LEN - 1))]))
        n = draw(st.integers(1, min(MAX_LEN - start, tokens - used)))
        spans.append((start, n))
        used += n
    return spans


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(spans=ragged_spans(), seed=st.integers(0, 2**16))
def test_matches_the_reference_on_ragged_batches(
    config: Config, spans: list[Span], seed: int
) -> None:
    check_against_reference(config, build(config, spans, tokens=64, seqs=8, seed=seed))


EDGE_CASES = {
    "decode rows of 1, 17, 32, 33 positions and a full table": [
        (0, 1), (16, 1), (31, 1), (32, 1), (MAX_LEN - 1, 1),
    ],
    "a chunk from 0, a chunk mid-sequence, a chunk of 1": [(3, 1), (0, 40), (70, 18), (90, 1)],
    "chunks only, the first of 1 query": [(50, 1), (0, 1), (100, 28)],
    "a chunk filling the table": [(0, MAX_LEN)],
    "one decode row, empty chunk slots and padding sequences": [(MAX_LEN - 1, 1)],
    "nothing": [],
}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS[:4], ids=str)
@pytest.mark.parametrize("spans", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_matches_the_reference_at_the_edges(config: Config, spans: list[Span]) -> None:
    check_against_reference(config, build(config, spans, tokens=128, seqs=16, seed=7))


def test_default_tiles_split_a_long_chunk() -> None:
    """The default sizes: a 200-query chunk is two tiles of 128, over two blocks of 128."""
    config = Config(2, 2, 64, window=150)
    spans = [(20, 1), (2 * MAX_LEN - 1, 1), (40, 200), (0, 129)]
    case = build(config, spans, tokens=512, seqs=4, num_pages=60, pages_per_seq=2 * PAGES_PER_SEQ)
    check_against_reference(config, case)


# Bit-exactness: one sequence's own queries and K/V, placed in different batches.
TARGET_LEN = 77  # three decode blocks of 32, the last partial


def own_data(config: Config, n: int, seed: int = 99) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, config.heads, config.head_dim)).astype(np.float32)
    kv = rng.standard_normal((TARGET_LEN, 2 * config.kv_heads, config.head_dim))
    return q, kv.astype(np.float32)


def target_output(
    config: Config, spans: list[Span], target: int, tokens: int, seqs: int, seed: int
) -> np.ndarray:
    n = spans[target][1]
    case = build(
        config,
        spans,
        tokens=tokens,
        seqs=seqs,
        seed=seed,
        fixed={target: own_data(config, n)},
    )
    return attend(config, case)[case.rows(target)]


@pytest.mark.parametrize("config", BIT_CONFIGS, ids=str)
def test_a_decode_row_has_the_same_bits_in_any_batch(config: Config) -> None:
    row = (TARGET_LEN - 1, 1)
    alone = target_output(config, [row], 0, tokens=8, seqs=1, seed=1)
    batches = {
        "a full batch": ([(p, 1) for p in (5, 60)] + [row] + [(p, 1) for p in range(0, 91, 7)], 2),
        "a bigger bucket": ([row], 0),
        "beside a much longer row": ([(MAX_LEN - 1, 1), row], 1),
        "before prompt chunks": ([row, (0, 30), (50, 20)], 0),
        "a one-query chunk after a chunk": ([(3, 1), (0, 20), row], 2),
    }
    for name, (spans, target) in batches.items():
        tokens, seqs = (16, 16) if name == "a full batch" else (64, 8)
        tokens, seqs = (128, 16) if name == "a bigger bucket" else (tokens, seqs)
        got = target_output(config, spans, target, tokens, seqs, seed=len(name))
        assert np.array_equal(got, alone), name


@pytest.mark.parametrize("config", BIT_CONFIGS, ids=str)
def test_a_prompt_chunk_has_the_same_bits_in_any_batch(config: Config) -> None:
    chunk = (TARGET_LEN - 45, 45)
    alone = target_output(config, [chunk], 0, tokens=64, seqs=8, seed=1)
    batches = {
        "after decode rows": ([(MAX_LEN - 1, 1), (4, 1), chunk], 2),
        "between chunks": ([(1, 1), (0, 10), chunk, (100, 8)], 2),
        "a bigger bucket": ([chunk], 0),
        "beside a much longer chunk": ([chunk, (MAX_LEN - 16, 16)], 0),
    }
    for name, (spans, target) in batches.items():
        tokens, seqs = (128, 16) if name == "a bigger bucket" else (64, 8)
        got = target_output(config, spans, target, tokens, seqs, seed=len(name))
        assert np.array_equal(got, alone), name


# float32 and bfloat16 pages: every row in the kernel
KERNEL_CONFIGS = [CONFIGS[0], Config(2, 4, 64, window=20), CONFIGS[2]]


@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=str)
def test_a_prompt_position_has_the_bits_of_its_decode_row(config: Config) -> None:
    """Through the kernel a query's bits do not depend on the form its sequence runs in:
    a chunk's rows equal the same queries as decode rows and as other chunks' rows, so
    neither chunking nor a prefix hit's length can change a bit."""
    q, kv = own_data(config, 45)
    first = TARGET_LEN - 45

    def run(spans: list[Span], target: int, start: int, stop: int) -> np.ndarray:
        fixed = {target: (q[start - first : stop - first], kv[:stop])}
        case = build(config, spans, tokens=64, seqs=8, seed=stop, fixed=fixed)
        return attend(config, case)[case.rows(target)]

    whole = run([(first, 45)], 0, first, TARGET_LEN)
    for i in (0, 17, 44):
        row = run([(5, 1), (20, 9), (first + i, 1)], 2, first + i, first + i + 1)
        assert np.array_equal(row[0], whole[i]), i
    split = first + 20
    parts = [run([(3, 1), (first, 20)], 1, first, split), run([(split, 25)], 0, split, TARGET_LEN)]
    assert np.array_equal(np.concatenate(parts), whole)


def test_a_fully_masked_block_keeps_the_state_bit_for_bit() -> None:
    rng = np.random.default_rng(5)
    top = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32).at[0, 0].set(-jnp.inf)
    total = jnp.asarray(rng.random((3, 4)), jnp.float32).at[0, 0].set(0.0)
    acc = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32).at[0, 0].set(0.0)
    scores = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.float32)
    (new_top, new_total, new_acc), probs = jax.jit(online_update)(
        (top, total, acc), scores, jnp.zeros((3, 4, 32), bool)
    )
    assert not np.asarray(probs).any()
    for before, after in ((top, new_top), (total, new_total), (acc, new_acc)):
        assert np.array_equal(np.asarray(before), np.asarray(after))


def test_the_kernel_serves_float32_and_bfloat16_pages_here() -> None:
    """The suite's machines build the kernel: float32 and bfloat16 rows above ran through
    it (XLA's forms where `kernel` is off, and for float16 and 8-bit pages)."""
    assert cpu_kernel.usable(layout_for(CONFIGS[0], 8), CONFIGS[0].heads)
    assert cpu_kernel.usable(layout_for(CONFIGS[2], 8), CONFIGS[2].heads)  # bfloat16
    float16 = Config(1, 4, 32, dtype="float16")
    assert not cpu_kernel.usable(layout_for(float16, 8), float16.heads)


def test_the_backend_per_platform() -> None:
    layout = KVLayout(8, PAGE, 2, 32)
    backend = attention_backend("cpu", layout, chunk_size=128, max_prefill_seqs=2)
    assert isinstance(backend, CpuAttention)
    assert isinstance(attention_backend("cpu", layout), ReferenceAttention)
    # GPU: the reference only when chosen (GpuAttention's own: tests/engine/test_attention_gpu.py)
    chosen = attention_backend(
        "gpu", layout, chunk_size=128, max_prefill_seqs=2, choice="reference"
    )
    assert isinstance(chosen, ReferenceAttention)
    with pytest.raises(ValueError):
        CpuAttention(KVLayout(8, PAGE, 2, 32, fold=2), chunk_size=128, max_prefill_seqs=2)
