"""The runner: device verbs of the engine core, one ragged step a call.

Runs on: the scheduler loop's thread. Owns: params placed on the mesh, the KV pages
(one array per layer, donated to every step), the per-row sampling state on the device
(token counts for penalties), and the jitted step, compiled once per (tokens, sequences)
bucket at warm-up. Receives a `StepPlan` from the scheduler; emits a `StepResult`
(host numpy: one sampled token per sequence of the plan, with logprobs).

No scheduling questions cross this seam: the plan says which tokens of which sequences
run, at which positions, in which pages; the runner pads them to a bucket and runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.attention import Attention, KVLayout
from engine.config import ModelConfig
from engine.model import Params
from engine.paged_model import Chunk, StepBatch, forward, make_batch
from engine.sampling import Sampled, SamplingArrays, host_arrays, sample
from engine.types import SamplingParams


@dataclass(frozen=True)
class RowWork:
    """One sequence's share of a step, as the scheduler planned it."""

    chunk: Chunk  # its tokens this step, their first position, its page table
    row: int  # its device row (penalty counts), 0..max_num_seqs - 1
    sampling: SamplingParams
    generated: int  # tokens it has sampled so far: which key its next token takes
    emits: bool = True  # the step samples its next token (not a prompt chunk short of the end)
    fresh: bool = False  # its first step: the row's counts start from zero...
    prior: tuple[int, ...] = ()  # ...plus these tokens it sampled before it was preempted


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[RowWork, ...]

    @property
    def tokens(self) -> int:
        return sum(len(r.chunk.tokens) for r in self.rows)


@dataclass(frozen=True)
class StepResult:
    tokens: np.ndarray  # (rows,) int32: each sequence's sampled token
    logprobs: np.ndarray  # (rows,) float32: its logprob (zeros unless some row asked)
    top_ids: np.ndarray  # (rows, MAX_LOGPROBS) int32
    top_logprobs: np.ndarray  # (rows, MAX_LOGPROBS) float32


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest`, ending with `largest` itself."""
    out, size = [], smallest
    while size < largest:
        out.append(size)
        size *= 2
    return (*out, largest)


def fit(count: int, sizes: Sequence[int]) -> int:
    for size in sizes:
        if count <= size:
            return size
    raise ValueError(f"{count} exceeds the largest bucket {sizes[-1]}")


def _step(
    params: Params,
    pages: tuple[jax.Array, ...],
    counts: jax.Array,
    batch: StepBatch,
    rows: jax.Array,
    emits: jax.Array,
    fresh: jax.Array,
    sampling: SamplingArrays,
    generated: jax.Array,
    eos_mask: jax.Array,
    inv_freq: jax.Array,
    *,
    cfg: ModelConfig,
    attention: Attention,
) -> tuple[Sampled, tuple[jax.Array, ...], jax.Array]:
    """forward + sample; each emitting row's counts gain its sampled token (padding rows
    point past the table and change nothing). A fresh row's counts are zeroed first."""
    logits, pages = forward(params, pages, batch, inv_freq, cfg, attention)
    counts = lax.cond(
        jnp.any(fresh),
        lambda c: c.at[jnp.where(fresh, rows, c.shape[0])].set(0, mode="drop"),
        lambda c: c,
        counts,
    )
    mine = counts.at[rows].get(mode="fill", fill_value=0)
    out = sample(logits, sampling, generated, mine, generated, eos_mask)
    counts = counts.at[rows, out.token].add(emits.astype(jnp.int32), mode="drop")
    return out, pages, counts


def _recount(counts: jax.Array, row: jax.Array, ids: jax.Array) -> jax.Array:
    """Row `row` of the counts: how often each of `ids` occurs (ids past the vocabulary
    are padding)."""
    vocab = counts.shape[1]
    fresh = jnp.zeros((vocab,), counts.dtype).at[ids].add(1, mode="drop")
    return counts.at[row].set(fresh)


class Runner:
    """Runs planned steps on one mesh's devices."""

    def __init__(
        self,
        params: Params,
        cfg: ModelConfig,
        layout: KVLayout,
        attention: Attention,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        min_tokens_bucket: int = 8,
    ) -> None:
        self.params = params
        self.cfg = cfg
        self.layout = layout
        self.max_num_seqs = max_num_seqs
        self.pages_per_seq = -(-max_model_len // layout.page_size)
        self.token_buckets = buckets(
            min(min_tokens_bucket, max_num_batched_tokens), max_num_batched_tokens
        )
        self.seq_buckets = buckets(1, max_num_seqs)
        self.pages = tuple(layout.empty() for _ in range(cfg.num_layers))
        self.counts = jnp.zeros((max_num_seqs, cfg.vocab_size), jnp.int32)
        eos = np.zeros((cfg.vocab_size,), bool)
        eos[[i for i in eos_token_ids if 0 <= i < cfg.vocab_size]] = True
        self.eos_mask = jnp.asarray(eos)
        self.inv_freq = jnp.asarray(cfg.rope_inv_freq())
        self._step = jax.jit(
            functools.partial(_step, cfg=cfg, attention=attention), donate_argnums=(1, 2)
        )
        self._recount = jax.jit(_recount, donate_argnums=(0,))
        self.max_model_len = max_model_len
        self._idle = SamplingParams(temperature=0.0, seed=0)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket pair a step may take."""
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets if s <= t]

    def warmup(self) -> None:
        """Compile every bucket pair now (before readiness), on padding only."""
        for tokens, seqs in self.shapes():
            self._run(StepPlan(()), tokens, seqs)

    def step(self, plan: StepPlan) -> StepResult:
        tokens = fit(plan.tokens, self.token_buckets)
        seqs = fit(len(plan.rows), [s for s in self.seq_buckets if s <= tokens])
        return self._run(plan, tokens, seqs)

    def _run(self, plan: StepPlan, tokens: int, seqs: int) -> StepResult:
        layout = self.layout
        for work in plan.rows:
            if work.prior:  # back after a preemption: its penalties count what it had
                ids = np.full(self.max_model_len, self.cfg.vocab_size, np.int32)
                ids[: len(work.prior)] = work.prior
                self.counts = self._recount(self.counts, np.int32(work.row), ids)
        batch = make_batch(
            [r.chunk for r in plan.rows],
            tokens=tokens,
            seqs=seqs,
            pages_per_seq=self.pages_per_seq,
            page_size=layout.page_size,
            num_pages=layout.num_pages,
        )
        real = len(plan.rows)
        rows = np.full(seqs, self.max_num_seqs, np.int32)  # padding: past the table
        rows[:real] = [r.row for r in plan.rows]
        emits = np.zeros(seqs, bool)
        emits[:real] = [r.emits for r in plan.rows]
        fresh = np.zeros(seqs, bool)
        fresh[:real] = [r.fresh for r in plan.rows]
        generated = np.zeros(seqs, np.int32)
        generated[:real] = [r.generated for r in plan.rows]
        per_row = [host_arrays(r.sampling, self.cfg.vocab_size) for r in plan.rows]
        idle = host_arrays(self._idle, self.cfg.vocab_size)
        per_row += [idle] * (seqs - real)
        stacked = [np.stack(field) for field in zip(*per_row, strict=True)]
        sampling = SamplingArrays(*cast(list[jax.Array], stacked))  # host arrays, as jit takes
        out, self.pages, self.counts = self._step(
            self.params,
            self.pages,
            self.counts,
            batch,
            rows,
            emits,
            fresh,
            sampling,
            generated,
            self.eos_mask,
            self.inv_freq,
        )
        host = jax.device_get(out)
        return StepResult(
            tokens=np.asarray(host.token[:real]),
            logprobs=np.asarray(host.logprob[:real]),
            top_ids=np.asarray(host.top_ids[:real]),
            top_logprobs=np.asarray(host.top_logprobs[:real]),
        )
