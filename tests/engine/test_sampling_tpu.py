"""engine.sampling_tpu: TPU's sampler keeps engine.sampling's meanings (greedy bits,
top-k, top-p, penalties, logprobs, seeded draws per row) and draws from a row's
TOP_CANDIDATES best tokens only. Runs on CPU: the form is plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import sampling, sampling_tpu
from engine.sampling import SamplingArrays, host_arrays
from engine.types import SamplingParams

VOCAB = 32
ROWS = 4000


def params(rows: int, vocab: int = VOCAB, **values: float) -> SamplingArrays:
    """rows copies of one request's sampling arrays, the i-th drawn with index i."""
    one = host_arrays(SamplingParams(seed=7, logprobs=5, **values), vocab)  # type: ignore[arg-type]
    return SamplingArrays(*(np.stack([a] * rows) for a in one))


def run(logits: np.ndarray, rows: int, sampler=sampling_tpu.sample, counts=None, **values):  # type: ignore[no-untyped-def]
    tiled = jnp.tile(jnp.asarray(logits, jnp.float32), (rows, 1))
    vocab = logits.shape[-1]
    counts = jnp.zeros((rows, vocab), jnp.int32) if counts is None else counts
    index = jnp.arange(rows, dtype=jnp.int32)
    zeros = jnp.zeros((rows,), jnp.int32)
    fn = jax.jit(lambda *a: sampler(*a, count_rows=index))
    out = fn(tiled, params(rows, vocab, **values), index, counts, zeros, np.zeros(vocab, bool))
    return jax.device_get(out)


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 2


def test_the_sampler_per_backend() -> None:
    assert sampling_tpu.backend_sampler("tpu") is sampling_tpu.sample
    assert sampling_tpu.backend_sampler("cpu") is sampling.sample
    assert sampling_tpu.backend_sampler("gpu") is sampling.sample


def test_greedy_rows_and_penalties_give_engine_samplings_tokens(logits: np.ndarray) -> None:
    counts = jnp.zeros((8, VOCAB), jnp.int32).at[:, int(np.argmax(logits))].set(2)
    for values in ({"temperature": 0.0}, {"temperature": 0.0, "presence_penalty": 5.0}):
        tpu = run(logits, 8, counts=counts, **values)
        cpu = run(logits, 8, sampler=sampling.sample, counts=counts, **values)
        np.testing.assert_array_equal(tpu.token, cpu.token)
    assert tpu.token[0] != np.argmax(logits)  # the penalty moved it


def test_top_k_and_top_p_keep_their_tokens(logits: np.ndarray) -> None:
    order = np.argsort(-logits)
    assert set(run(logits, ROWS, top_k=5).token) <= set(order[:5])
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[before < 0.5])
    assert set(run(logits, ROWS, top_p=0.5).token) <= nucleus


def test_draws_follow_the_softmax_within_the_candidates(logits: np.ndarray) -> None:
    """VOCAB < TOP_CANDIDATES: every token is a candidate, so temperature 0.7 draws
    follow softmax(logits / 0.7)."""
    tokens = run(logits, ROWS, temperature=0.7).token
    want = np.exp((logits - logits.max()) / 0.7)
    want /= want.sum()
    got = np.bincount(tokens, minlength=VOCAB) / ROWS
    assert np.abs(got - want).max() < 0.03


def test_a_row_draws_only_among_its_best_candidates() -> None:
    vocab = 4 * sampling_tpu.TOP_CANDIDATES
    flat = np.zeros(vocab, np.float32)  # every token equally likely: the tail is real mass
    flat[::2] += 1e-3  # the even tokens are the best ones
    tokens = run(flat, 2000).token
    assert set(tokens) <= set(range(0, 2 * sampling_tpu.TOP_CANDIDATES, 2))
    assert len(set(tokens)) > sampling_tpu.TOP_CANDIDATES // 2


def test_a_row_draws_the_same_alone_and_in_a_batch(logits: np.ndarray) -> None:
    alone = run(logits, 1, top_p=0.9, top_k=20)
    rows = np.stack([logits, logits[::-1], logits * 3])
    batch = params(3, top_p=0.9, top_k=20)
    out = jax.jit(lambda *a: sampling_tpu.sample(*a))(
        jnp.asarray(rows),
        batch,
        jnp.zeros((3,), jnp.int32),
        jnp.zeros((3, VOCAB), jnp.int32),
        jnp.zeros((3,), jnp.int32),
        np.zeros(VOCAB, bool),
    )
    assert int(out.token[0]) == int(alone.token[0])


def test_logprobs_are_the_raw_logits_log_softmax(logits: np.ndarray) -> None:
    out = run(logits, 2, temperature=0.7)
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
    np.testing.assert_allclose(out.logprob, want[out.token], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids[0, :5], np.argsort(-want)[:5])


@pytest.mark.parametrize("vocab", [32, 1000, 128256])
def test_the_bitmask_spread_by_a_product_masks_as_engine_sampling_does(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = jnp.asarray(rng.integers(-(2**31), 2**31, (3, words), dtype=np.int64), jnp.int32)
    bitmask = bitmask.at[2].set(-1)  # every token allowed: the row is kept bit for bit
    logits = jnp.asarray(rng.standard_normal((3, vocab)), jnp.float32)
    want = sampling.apply_token_bitmask(logits, bitmask)
    got = jax.jit(sampling_tpu.apply_token_bitmask)(logits, bitmask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
