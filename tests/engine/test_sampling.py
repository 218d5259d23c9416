"""On-device sampling: greedy, top-k, top-p, the softmax distribution, penalties, logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampling import (
    SamplingArrays,
    apply_token_bitmask,
    argmax,
    host_arrays,
    sample,
    seed_key,
    token_bitmask,
)
from engine.types import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

VOCAB = 32
ROWS = 4000


def batch(rows: int, vocab: int = VOCAB, **values) -> SamplingArrays:
    """rows copies of one row's sampling; logit_bias and allowed_token_ids as in SamplingParams."""
    full = lambda v, dt: jnp.full((rows,), v, dt)
    bias = host_arrays(
        SamplingParams(
            seed=0,
            logit_bias=values.get("logit_bias", ()),
            allowed_token_ids=values.get("allowed_token_ids"),
            logprobs=0 if values.get("logprob_token_ids") else None,
            logprob_token_ids=values.get("logprob_token_ids"),
        ),
        vocab,
    )
    tile = lambda a: jnp.tile(jnp.asarray(a), (rows, 1) if a.ndim else (rows,))
    return SamplingArrays(
        temperature=full(values.get("temperature", 1.0), jnp.float32),
        top_k=full(values.get("top_k", 0), jnp.int32),
        top_p=full(values.get("top_p", 1.0), jnp.float32),
        presence_penalty=full(values.get("presence_penalty", 0.0), jnp.float32),
        frequency_penalty=full(values.get("frequency_penalty", 0.0), jnp.float32),
        repetition_penalty=full(values.get("repetition_penalty", 1.0), jnp.float32),
        min_tokens=full(values.get("min_tokens", 0), jnp.int32),
        key=jnp.tile(jnp.asarray(seed_key(int(values.get("seed", 7)))), (rows, 1)),
        logprobs=full(values.get("logprobs", True), bool),
        bias_ids=tile(bias.bias_ids),
        bias_values=tile(bias.bias_values),
        allowed=tile(bias.allowed),
        masked=tile(bias.masked),
        picked_ids=tile(bias.picked_ids),
    )


@jax.jit
def run(logits, params, index, counts, generated, eos_mask):
    return sample(logits, params, index, counts, generated, eos_mask)


def draw(logits: np.ndarray, rows: int = ROWS, counts=None, generated=None, eos=(), **values):
    """`rows` draws from one logit vector, the i-th with key index i."""
    tiled = jnp.tile(jnp.asarray(logits, jnp.float32), (rows, 1))
    counts = jnp.zeros((rows, len(logits)), jnp.int32) if counts is None else counts
    generated = jnp.zeros((rows,), jnp.int32) if generated is None else generated
    eos_mask = np.zeros((len(logits),), bool)
    eos_mask[list(eos)] = True
    index = jnp.arange(rows, dtype=jnp.int32)
    params = batch(rows, len(logits), **values)
    return jax.device_get(run(tiled, params, index, counts, generated, eos_mask))


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 2


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(16, VOCAB)).astype(np.float32)
    out = jax.device_get(
        run(
            jnp.asarray(rows),
            batch(16, temperature=0.0),
            jnp.arange(16, dtype=jnp.int32),
            jnp.zeros((16, VOCAB), jnp.int32),
            jnp.zeros((16,), jnp.int32),
            jnp.zeros((VOCAB,), bool),
        )
    )
    np.testing.assert_array_equal(out.token, rows.argmax(axis=-1))


def test_top_k_never_leaves_the_k_best(logits):
    best = set(np.argsort(-logits)[:5].tolist())
    tokens = set(draw(logits, top_k=5, temperature=1.5).token.tolist())
    assert tokens <= best
    assert len(tokens) == 5  # and it does sample among all of them


def test_top_p_never_leaves_the_nucleus(logits):
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[before < 0.6].tolist())
    tokens = set(draw(logits, top_p=0.6).token.tolist())
    assert tokens <= nucleus
    assert len(tokens) == len(nucleus) > 1


def test_top_k_and_top_p_combine(logits):
    order = np.argsort(-logits)
    top3 = logits[order[:3]]
    probs = np.exp(top3 - top3.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    allowed = set(order[:3][before < 0.7].tolist())
    tokens = set(draw(logits, top_k=3, top_p=0.7).token.tolist())
    assert tokens <= allowed


def test_temperature_one_matches_softmax():
    """Chi-square goodness of fit of 20000 fixed-seed draws against softmax(logits)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.25], np.float32)
    rows = 20000
    tokens = draw(logits, rows=rows, seed=123).token
    expected = np.exp(logits) / np.exp(logits).sum() * rows
    observed = np.bincount(tokens, minlength=len(logits))
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, observed, expected)  # df = 7, p = 0.001


def test_seeded_draw_depends_only_on_seed_and_index(logits):
    a = draw(logits, rows=64, seed=99).token
    b = draw(logits, rows=64, seed=99).token
    c = draw(logits, rows=64, seed=100).token
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_presence_and_frequency_penalties_steer_greedy(logits):
    best = int(np.argmax(logits))
    counts = jnp.zeros((1, VOCAB), jnp.int32).at[0, best].set(2)
    plain = draw(logits, rows=1, counts=counts, temperature=0.0)
    presence = draw(logits, rows=1, counts=counts, temperature=0.0, presence_penalty=100.0)
    frequency = draw(logits, rows=1, counts=counts, temperature=0.0, frequency_penalty=50.0)
    assert plain.token[0] == best
    assert presence.token[0] != best and frequency.token[0] != best
    # logprobs stay those of the raw logits
    np.testing.assert_allclose(presence.top_logprobs, plain.top_logprobs)


def test_repetition_penalty_is_vllms_over_the_prompt_and_the_output():
    """vLLM's (and transformers') formula, in its order: every token seen in the prompt
    (marked PROMPT_SEEN in the counts) or the output has a positive logit divided by the
    penalty and a negative one multiplied; presence and frequency then read the output's
    counts only. The greedy token is the argmax of exactly those logits."""
    from engine.sampling import PROMPT_SEEN, _adjust

    rng = np.random.default_rng(3)
    vocab = 50
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3
    output = rng.integers(0, 3, size=(3, vocab)).astype(np.int32)
    prompt = rng.random((3, vocab)) < 0.3
    counts = output + np.where(prompt, PROMPT_SEEN, 0).astype(np.int32)
    rows = [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.6, presence_penalty=0.5, frequency_penalty=0.25),
        dict(presence_penalty=0.5),  # no repetition: its prompt marks are never set
    ]
    counts[2] = output[2]
    params = jax.tree.map(lambda *a: jnp.concatenate(a), *[batch(1, vocab, **kw) for kw in rows])
    got = np.asarray(
        _adjust(jnp.asarray(logits), params, jnp.asarray(counts), jnp.zeros(3, jnp.int32),
                jnp.zeros(vocab, bool))
    )  # fmt: skip
    for i, kw in enumerate(rows):
        want = logits[i].copy()
        r = np.float32(kw.get("repetition_penalty", 1.0))
        seen = (output[i] > 0) | (prompt[i] if r != 1 else False)
        want = np.where(seen, np.where(want > 0, want / r, want * r), want)
        want = want - np.float32(kw.get("presence_penalty", 0.0)) * (output[i] > 0)
        want = want - np.float32(kw.get("frequency_penalty", 0.0)) * output[i]
        # XLA may divide by the row's penalty as a product with its reciprocal: 1 ulp
        np.testing.assert_allclose(got[i], want.astype(np.float32), rtol=3e-7, atol=0)
    tokens = draw(logits[0], rows=1, counts=jnp.asarray(counts[:1]), temperature=0.0,
                  repetition_penalty=1.7).token  # fmt: skip
    assert tokens[0] == int(np.argmax(got[0]))
    plain = draw(logits[0], rows=1, counts=jnp.asarray(counts[:1]), temperature=0.0).token
    assert plain[0] == int(np.argmax(logits[0]))  # marks alone change nothing


def test_min_tokens_holds_back_eos(logits):
    eos = int(np.argmax(logits))
    held = draw(
        logits,
        rows=1,
        eos=(eos,),
        temperature=0.0,
        min_tokens=3,
        generated=jnp.array([2], jnp.int32),
    )
    free = draw(
        logits,
        rows=1,
        eos=(eos,),
        temperature=0.0,
        min_tokens=3,
        generated=jnp.array([3], jnp.int32),
    )
    assert held.token[0] != eos
    assert free.token[0] == eos


def test_logprobs_are_of_raw_logits_sorted_and_max_wide(logits):
    out = draw(logits, rows=8, temperature=0.3, top_k=4)
    raw = logits - logits.max()
    raw = raw - np.log(np.exp(raw).sum())
    assert out.top_ids.shape == (8, MAX_LOGPROBS)
    np.testing.assert_array_equal(out.top_ids[0], np.argsort(-raw)[:MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs[0], np.sort(raw)[::-1][:MAX_LOGPROBS], atol=1e-5)
    np.testing.assert_allclose(out.logprob, raw[out.token], atol=1e-5)


def test_logprobs_only_for_batches_that_ask_and_tokens_the_same_either_way(logits):
    """Rows that want logprobs get them beside rows that don't; a batch where no row
    wants them gets zeros; the sampled tokens never depend on it."""
    rows = 6
    tiled = jnp.tile(jnp.asarray(logits), (rows, 1))
    index = jnp.arange(rows, dtype=jnp.int32)
    zeros = jnp.zeros((rows,), jnp.int32)
    args = (index, jnp.zeros((rows, VOCAB), jnp.int32), zeros, np.zeros((VOCAB,), bool))
    mixed = batch(rows, temperature=0.8, seed=3)._replace(
        logprobs=jnp.array([True, False] * (rows // 2))
    )
    none = batch(rows, temperature=0.8, seed=3, logprobs=False)
    with_lp = jax.device_get(run(tiled, mixed, *args))
    without = jax.device_get(run(tiled, none, *args))

    np.testing.assert_array_equal(with_lp.token, without.token)
    raw = logits - logits.max()
    raw = raw - np.log(np.exp(raw).sum())
    np.testing.assert_allclose(with_lp.logprob[0], raw[with_lp.token[0]], atol=1e-5)
    np.testing.assert_array_equal(with_lp.top_ids[0], np.argsort(-raw)[:MAX_LOGPROBS])
    assert not np.any(without.logprob) and not np.any(without.top_logprobs)


@pytest.mark.parametrize("special", [[], [2], [0, 5, 6, 7], [0, 1, 3, 5, 6]])
def test_a_row_samples_the_same_alone_and_in_every_batch_path(special):
    """Greedy rows only (argmax alone), at most GATHERED_ROWS rows that need more (those
    rows sampled apart), more than that (the whole batch): each row as it is alone."""
    from engine.sampling import GATHERED_ROWS

    rows, vocab = 8, 600
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    kinds = [
        dict(temperature=0.9, seed=11, logprobs=True),
        dict(temperature=0.0, logprobs=True),
        dict(temperature=0.7, top_k=5, top_p=0.8, seed=12),
        dict(temperature=0.0, frequency_penalty=3.0),
        dict(temperature=0.0, min_tokens=2, repetition_penalty=1.5),
        dict(temperature=0.5, seed=13, logprobs=True, logprob_token_ids=(5, 0, 599, 5)),
    ]
    per_row = [
        kinds[i % len(kinds)] if i in special else dict(temperature=0.0) for i in range(rows)
    ]
    params = [batch(1, vocab, **{"logprobs": False, "seed": 7, **kw}) for kw in per_row]
    stacked = jax.tree.map(lambda *a: jnp.concatenate(a), *params)
    counts = jnp.asarray(rng.integers(0, 3, size=(rows, vocab)).astype(np.int32))
    index = jnp.arange(rows, dtype=jnp.int32) + 3
    generated = jnp.ones((rows,), jnp.int32)
    eos = np.zeros((vocab,), bool)
    eos[int(np.argmax(np.asarray(logits[4])))] = True
    together = jax.device_get(run(logits, stacked, index, counts, generated, eos))
    assert (0 < len(special) <= GATHERED_ROWS) == (len(special) in (1, 4))
    for i in range(rows):
        alone = jax.device_get(
            run(logits[i : i + 1], params[i], index[i : i + 1], counts[i : i + 1],
                generated[i : i + 1], eos)
        )  # fmt: skip
        assert together.token[i] == alone.token[0], i
        if per_row[i].get("logprobs"):
            np.testing.assert_array_equal(together.logprob[i], alone.logprob[0])
            np.testing.assert_array_equal(together.top_ids[i], alone.top_ids[0])
            np.testing.assert_array_equal(together.picked_logprobs[i], alone.picked_logprobs[0])
    vocab_major = jax.device_get(
        run_vocab_major(logits.T, stacked, index, counts, generated, eos)
    )  # a decode step's layout (engine.model.step_logits): the same, bit for bit
    for got, want in zip(vocab_major, together, strict=True):
        np.testing.assert_array_equal(got, want)


@jax.jit
def run_vocab_major(logits, params, index, counts, generated, eos_mask):
    return sample(logits, params, index, counts, generated, eos_mask, vocab_major=True)


@pytest.mark.parametrize("vocab", [40, 2000, 2003])  # one pass; blocks of 500; no divisor
def test_argmax_is_the_first_maximum(vocab):
    rng = np.random.default_rng(2)
    rows = rng.integers(-3, 3, size=(64, vocab)).astype(np.float32)  # many ties
    rows[5] = -np.inf
    rows[6, 17] = np.inf
    rows[7, 499:501] = 9.0  # a tie across a block boundary
    rows[8, [3, vocab - 1]] = np.nan
    rows[9:12] = -5.0  # maxima past the first block
    rows[9, vocab - 1] = 1.0
    rows[10, [vocab // 2, vocab - 2]] = 2.0
    rows[11, 1:vocab:3] = 4.0
    got = jax.device_get(jax.jit(argmax)(jnp.asarray(rows)))
    np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))
    columns = jax.device_get(jax.jit(argmax, static_argnums=1)(jnp.asarray(rows.T), 0))
    np.testing.assert_array_equal(columns, np.argmax(rows, axis=-1))


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_seed_key_is_prng_key_of_the_seed(seed):
    np.testing.assert_array_equal(seed_key(seed), np.asarray(jax.random.PRNGKey(seed)))


def reference_mask(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Sort-based top-k then top-p, in float64."""
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(row.shape, bool)
    keep[order[: top_k if top_k > 0 else len(row)]] = True
    masked = np.where(keep, row.astype(np.float64), -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = np.zeros(row.shape, bool)
    nucleus[order[before < top_p]] = True
    return keep & nucleus


def test_filters_exact_on_both_the_fast_and_the_bisection_path():
    """k beyond the candidate window and wide nuclei take the bisection; each row alone agrees."""
    from engine.sampling import CANDIDATES, _filter_mask

    rng = np.random.default_rng(5)
    vocab = 512
    rows = rng.normal(size=(6, vocab)).astype(np.float32) * np.array(
        [[3], [0.1], [2], [0.05], [1], [4]]
    )
    top_k = np.array([5, 0, 200, 0, CANDIDATES + 30, 0], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 0.5, 0.8, 0.3], np.float32)
    run = jax.jit(_filter_mask)
    batch_mask = np.asarray(run(jnp.asarray(rows), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i in range(len(rows)):
        want = reference_mask(rows[i], int(top_k[i]), float(top_p[i]))
        assert (batch_mask[i] == want).all(), i
        alone = run(
            jnp.asarray(rows[i : i + 1]),
            jnp.asarray(top_k[i : i + 1]),
            jnp.asarray(top_p[i : i + 1]),
        )
        assert (np.asarray(alone)[0] == batch_mask[i]).all(), i
    assert batch_mask[1].sum() > CANDIDATES and batch_mask[3].sum() > CANDIDATES  # slow path used


def test_token_bitmask_sets_bit_t_mod_32_of_word_t_div_32():
    words = token_bitmask([0, 1, 31, 32, 65, 99], 100).view(np.uint32)
    assert words.tolist() == [0x80000003, 0x1, 0x2, 0x8]
    assert token_bitmask(None, 100).tolist() == [-1] * 4


def test_apply_token_bitmask_keeps_allowed_logits_bit_for_bit():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 70)).astype(np.float32)
    masks = np.stack([token_bitmask([3, 40, 69], 70), token_bitmask(None, 70)])
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(masks)))
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [3, 40, 69]
    np.testing.assert_array_equal(out[0, [3, 40, 69]], logits[0, [3, 40, 69]])
    np.testing.assert_array_equal(out[1], logits[1])


def test_logit_bias_steers_greedy_and_leaves_logprobs_raw(logits):
    best, worst = int(np.argmax(logits)), int(np.argmin(logits))
    plain = draw(logits, rows=1, temperature=0.0)
    up = draw(logits, rows=1, temperature=0.0, logit_bias=((worst, 100.0),))
    down = draw(logits, rows=1, temperature=0.0, logit_bias=((best, -100.0),))
    assert plain.token[0] == best and up.token[0] == worst
    assert down.token[0] == int(np.argsort(-logits)[1])
    np.testing.assert_array_equal(up.top_logprobs, plain.top_logprobs)


def test_a_full_logit_bias_applies_every_entry():
    vocab = 400
    logits = np.zeros((vocab,), np.float32)
    bias = tuple((i, -100.0) for i in range(MAX_LOGIT_BIAS))
    out = draw(logits, rows=256, logit_bias=bias, temperature=1.0)
    assert out.token.min() >= MAX_LOGIT_BIAS  # every biased id, the last entry's included
    big = draw(logits, rows=1, temperature=0.0, logit_bias=bias[:-1] + ((399, 5.0),))
    assert big.token[0] == 399


def test_allowed_token_ids_restrict_every_draw(logits):
    allowed = (1, 7, 30)
    out = draw(logits, rows=2000, allowed_token_ids=allowed, temperature=1.0)
    assert set(out.token.tolist()) == set(allowed)
    greedy = draw(logits, rows=1, allowed_token_ids=allowed, temperature=0.0)
    assert greedy.token[0] == max(allowed, key=lambda t: logits[t])
    filtered = draw(logits, rows=500, allowed_token_ids=allowed, top_k=2, temperature=2.0)
    assert set(filtered.token.tolist()) == set(sorted(allowed, key=lambda t: -logits[t])[:2])


def test_a_mask_holds_against_a_bias_and_min_tokens_holds_eos(logits):
    allowed = (2, 5, 9)
    eos = max(allowed, key=lambda t: logits[t])
    out = draw(
        logits,
        rows=300,
        eos=(eos,),
        min_tokens=1,
        logit_bias=((0, 100.0), (eos, 100.0)),
        allowed_token_ids=allowed,
        temperature=1.0,
    )
    assert set(out.token.tolist()) <= set(allowed) - {eos}


def test_rows_without_bias_or_mask_sample_as_they_do_alone():
    """A batch where some rows have a bias or a mask: the others keep their bits."""
    rng = np.random.default_rng(5)
    rows, vocab = 6, 600
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))
    args = (
        jnp.arange(rows, dtype=jnp.int32),
        jnp.zeros((rows, vocab), jnp.int32),
        jnp.zeros((rows,), jnp.int32),
        np.zeros((vocab,), bool),
    )
    for temperature in (0.0, 0.9):
        plain = batch(rows, vocab, temperature=temperature, logprobs=False)
        special = batch(
            rows, vocab, temperature=temperature, logprobs=False, logit_bias=((3, 50.0),)
        )
        masked = batch(rows, vocab, allowed_token_ids=(1, 2))
        mixed = jax.tree.map(
            lambda p, b, m: jnp.concatenate([p[:2], b[2:4], m[4:]]), plain, special, masked
        )
        alone = jax.device_get(run(logits, plain, *args))
        together = jax.device_get(run(logits, mixed, *args))
        np.testing.assert_array_equal(together.token[:2], alone.token[:2])
        assert together.token[2:4].tolist() == [3, 3]
        assert set(together.token[4:].tolist()) <= {1, 2}


def test_picked_ids_logprobs_have_the_bits_of_the_top_ones(logits):
    """vLLM's logprob_token_ids: a row's named ids get their logprobs of the raw logits, the
    same bits the top logprobs give the same ids (one log-softmax), in the order named;
    a row that names none gets zeros beside it, and tokens do not change."""
    raw = logits - logits.max()
    raw = raw - np.log(np.exp(raw).sum())
    best = [int(t) for t in np.argsort(-raw)[:3]]
    named = (best[2], 31, best[0], 0)
    rows = 4
    tiled = jnp.tile(jnp.asarray(logits), (rows, 1))
    args = (
        jnp.arange(rows, dtype=jnp.int32),
        jnp.zeros((rows, VOCAB), jnp.int32),
        jnp.zeros((rows,), jnp.int32),
        np.zeros((VOCAB,), bool),
    )
    picking = batch(rows, temperature=0.8, seed=3, logprob_token_ids=named)
    plain = batch(rows, temperature=0.8, seed=3)
    mixed = jax.tree.map(lambda a, b: jnp.concatenate([a[:2], b[2:]]), picking, plain)
    out = jax.device_get(run(tiled, mixed, *args))
    top = dict(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist(), strict=True))
    picked = out.picked_logprobs[0, : len(named)]
    assert [picked[0], picked[2]] == [top[best[2]], top[best[0]]]  # bit for bit
    np.testing.assert_allclose(picked, raw[list(named)], atol=1e-5)
    np.testing.assert_array_equal(out.picked_logprobs[1], out.picked_logprobs[0])
    assert not np.any(out.picked_logprobs[2:])
    np.testing.assert_array_equal(out.token, jax.device_get(run(tiled, plain, *args)).token)


def test_sampling_params_bound_logprob_token_ids():
    with pytest.raises(ValueError, match="empty") as info:
        SamplingParams(logprobs=0, logprob_token_ids=())
    assert info.value.param == "logprob_token_ids"
    with pytest.raises(ValueError, match="greater than max allowed: 128"):
        SamplingParams(logprobs=0, logprob_token_ids=tuple(range(129)))
    with pytest.raises(ValueError, match="`logprobs` must be set"):
        SamplingParams(logprob_token_ids=(1,))
    SamplingParams(logprobs=5, logprob_token_ids=tuple(range(128)))  # the most served
    with pytest.raises(ValueError, match="outside the vocabulary") as info:
        SamplingParams(logprobs=0, logprob_token_ids=(3, 32)).check_vocab(32)
    assert info.value.param == "logprob_token_ids"


def test_sampling_params_bound_the_new_fields():
    with pytest.raises(ValueError, match="at most 300"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301)))
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias=((1, 100.5),))
    with pytest.raises(ValueError, match="twice"):
        SamplingParams(logit_bias=((1, 1.0), (1, 2.0)))
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(allowed_token_ids=())
    with pytest.raises(ValueError, match="outside the vocabulary") as info:
        SamplingParams(allowed_token_ids=(5, 32)).check_vocab(32)
    assert info.value.param == "allowed_token_ids"
