"""The runner: device verbs of the engine core, one ragged step a call.

Runs on: the scheduler loop's thread. Owns: params placed on the mesh (layers stacked),
the KV pages (every layer's in one array, KVLayout.stacked, split over the mesh by kv
head, donated to every step), the per-row sampling state on the device (token counts
for penalties, a repetition penalty's prompt marked there), and the jitted programs,
compiled for every shape in `Shapes` at warm-up. Receives a `StepPlan` from the
scheduler; emits a `StepResult` (host numpy: one sampled token per sequence of the plan,
with logprobs, and the prompt logprobs the plan asked for).

No scheduling questions cross this seam: the plan says which tokens of which sequences
run, at which positions, in which pages; the runner pads them to a bucket and runs.
Besides steps, it reads and writes whole pages (`read_pages`, `write_pages`: a
disaggregated core copying a prompt's K/V from one device set's pages to another's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine import rowwise
from engine.attention import Attention, KVLayout
from engine.config import ModelConfig
from engine.core.plan import PromptLogprobs, RowWork, StepPlan, StepResult
from engine.core.shapes import SINGLE_ROW_BUCKET, Shapes
from engine.logprobs import top_logprobs
from engine.model import Params
from engine.paged_model import (
    Chunk,
    StepBatch,
    forward,
    head_logits,
    make_batch,
    packed_products,
    row_invariant_products,
    stack_layers,
)
from engine.sampling import PROMPT_SEEN, Sampled, SamplingArrays, host_arrays, sample
from engine.sampling_tpu import backend_sampler
from engine.types import MAX_LOGPROBS, SamplingParams

MODEL_AXIS = "model"


# a step's sampled tokens, pages, counts, last tokens and hidden states (`step_program`)
StepOutputs = tuple[Sampled, jax.Array, jax.Array, jax.Array, jax.Array]


def step_program(
    params: Params,
    pages: jax.Array,
    counts: jax.Array,
    last: jax.Array,
    batch: StepBatch,
    carry: jax.Array,
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
    sampler: Callable[..., Sampled] = sample,
) -> StepOutputs:
    """forward + sample (`sampler`: the backend's, engine.sampling_tpu.backend_sampler);
    each emitting row's counts gain its sampled token (padding rows point past the table
    and change nothing). A fresh row's counts are zeroed first.

    Token t is `last[carry[t]]` where carry[t] >= 0: the step before's sampled tokens,
    read on the device (a row planned before that step finished). Returns this step's
    sampled tokens as the next `last` (max_num_seqs entries, zero-padded), and every
    token's final hidden state, for prompt logprobs."""
    tokens = jnp.where(carry >= 0, last[jnp.maximum(carry, 0)], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    x, pages = forward(params, pages, batch, inv_freq, cfg, attention)
    logits = head_logits(params, x[batch.last], cfg, live=batch.attention.num_seqs[0])
    counts = lax.cond(
        jnp.any(fresh),
        lambda c: c.at[jnp.where(fresh, rows, c.shape[0])].set(0, mode="drop"),
        lambda c: c,
        counts,
    )
    # Only rows with penalties read their counts (a gather of every row's is a pass over
    # (rows x vocab) that greedy steps would pay for nothing).
    out = sampler(logits, sampling, generated, counts, generated, eos_mask, count_rows=rows)
    counts = counts.at[rows, out.token].add(emits.astype(jnp.int32), mode="drop")
    last = lax.dynamic_update_slice(jnp.zeros_like(last), out.token.astype(last.dtype), (0,))
    return out, pages, counts, last, x


def fill_program(
    params: Params,
    pages: jax.Array,
    batch: StepBatch,
    inv_freq: jax.Array,
    *,
    cfg: ModelConfig,
    attention: Attention,
) -> jax.Array:
    """The batch's K/V written into the pages, nothing sampled (a draft model following
    the target's steps: no head, no sampling)."""
    return forward(params, pages, batch, inv_freq, cfg, attention)[1]


def prompt_logprobs_program(
    params: Params, x: jax.Array, following: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's logprob of the token after it (`following`; padding any id) and the
    MAX_LOGPROBS best, from the step's hidden states."""
    logprobs = rowwise.log_softmax(head_logits(params, x, cfg), cfg.fixed_order_sums)
    index = jnp.clip(following, 0, logprobs.shape[-1] - 1)
    chosen = jnp.take_along_axis(logprobs, index[:, None], axis=-1)[:, 0]
    values, ids = top_logprobs(logprobs)
    return chosen, ids, values


def _recount(counts: jax.Array, row: jax.Array, ids: jax.Array, seen: jax.Array) -> jax.Array:
    """Row `row` of the counts: how often each of `ids` occurs, plus PROMPT_SEEN at each
    of `seen` (a repetition penalty's prompt); ids past the vocabulary are padding."""
    vocab = counts.shape[1]
    fresh = jnp.zeros((vocab,), counts.dtype).at[ids].add(1, mode="drop")
    marked = jnp.zeros((vocab,), counts.dtype).at[seen].max(PROMPT_SEEN, mode="drop")
    return counts.at[row].set(fresh + marked)


def _layer_ids(ids: jax.Array, layers: int, per_layer: int) -> jax.Array:
    """Pages `ids` of every layer in stacked pages (KVLayout.stacked), layer by layer;
    an id past a layer's pages (padding) past every layer's."""
    shifted = ids[None, :] + per_layer * jnp.arange(layers, dtype=jnp.int32)[:, None]
    return jnp.where(ids[None, :] < per_layer, shifted, layers * per_layer).reshape(-1)


def _read_pages(pages: jax.Array, ids: jax.Array, *, layout: KVLayout, layers: int) -> jax.Array:
    stacked = layout.stacked(layers)
    return stacked.take(pages, _layer_ids(ids, layers, layout.num_pages))


def _write_pages(
    pages: jax.Array, ids: jax.Array, blocks: jax.Array, *, layout: KVLayout, layers: int
) -> jax.Array:
    stacked = layout.stacked(layers)
    return stacked.put(pages, _layer_ids(ids, layers, layout.num_pages), blocks)


def _held(
    *args: object, program: Callable[..., StepOutputs], pages: NamedSharding, whole: NamedSharding
) -> StepOutputs:
    """`program` with the state it carries (pages, counts, last tokens) leaving in the
    shardings it came in: each step's outputs are the next step's inputs, and a compiled
    step takes only the shardings it was compiled for."""
    out, new_pages, counts, last, hidden = program(*args)
    pin = lax.with_sharding_constraint
    return out, pin(new_pages, pages), pin(counts, whole), pin(last, whole), hidden


def pages_sharding(mesh: Mesh, layout: KVLayout) -> NamedSharding:
    """A layer's pages split by kv head (the combined-heads axis) over the mesh."""
    if mesh.devices.size == 1:
        return NamedSharding(mesh, PartitionSpec())
    spec: list[str | None] = [None] * len(layout.shape)
    spec[layout.head_axis] = MODEL_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


@dataclass(frozen=True)
class StepCall:
    """One step's device work as host arrays, nothing else: what `execute` runs, and what
    a multi-host leader sends its followers to run in the same order (engine.multihost)."""

    batch: StepBatch  # host arrays, padded to a bucket of Shapes
    rows: np.ndarray  # (S,) int32: device rows; padding past the table
    emits: np.ndarray  # (S,) bool
    fresh: np.ndarray  # (S,) bool
    sampling: SamplingArrays  # (S, ...) host arrays
    generated: np.ndarray  # (S,) int32
    # rows whose counts are rebuilt first: (row, (2, max_model_len) ids: counted, then seen)
    recount: tuple[tuple[int, np.ndarray], ...] = ()
    following: np.ndarray | None = None  # (T,) int32: prompt logprobs' next tokens
    carry: np.ndarray | None = None  # (T,) int32: tokens from the step before (None: none)

    @property
    def tokens(self) -> int:
        return int(np.asarray(self.batch.tokens).shape[0])


@dataclass(frozen=True)
class Launched:
    """A step's outputs on the device, not yet copied to the host."""

    sampled: Sampled
    prompt: tuple[jax.Array, jax.Array, jax.Array] | None


class Runner:
    """Runs planned steps on one mesh's devices."""

    def __init__(
        self,
        params: Params,
        cfg: ModelConfig,
        layout: KVLayout,
        attention: Attention,
        mesh: Mesh,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.params = packed_products(stack_layers(params, consume=True), cfg, consume=True)
        self.cfg = cfg
        self.layout = layout
        self.mesh = mesh
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.shapes = Shapes.of(
            max_num_seqs,
            max_num_batched_tokens,
            -(-max_model_len // layout.page_size),
            single_row=row_invariant_products(self.params, cfg),
        )
        whole = NamedSharding(mesh, PartitionSpec())
        stacked = layout.stacked(cfg.num_layers)
        self.pages = jax.jit(stacked.empty, out_shardings=pages_sharding(mesh, stacked))()
        self.counts = jax.device_put(np.zeros((max_num_seqs, cfg.vocab_size), np.int32), whole)
        self.last = jax.device_put(np.zeros((max_num_seqs,), np.int32), whole)  # sampled
        eos = np.zeros((cfg.vocab_size,), bool)
        eos[[i for i in eos_token_ids if 0 <= i < cfg.vocab_size]] = True
        self.eos_mask = jax.device_put(eos, whole)
        self.inv_freq = jax.device_put(cfg.rope_inv_freq(), whole)
        program = functools.partial(
            step_program,
            cfg=cfg,
            attention=attention,
            sampler=backend_sampler(mesh.devices.flat[0].platform),
        )
        held = functools.partial(
            _held, program=program, pages=pages_sharding(mesh, stacked), whole=whole
        )
        self._step = jax.jit(held, donate_argnums=(1, 2, 3))
        self._prompt = jax.jit(functools.partial(prompt_logprobs_program, cfg=cfg))
        self._recount = jax.jit(_recount, donate_argnums=(0,))
        layers = cfg.num_layers
        self._read_pages = jax.jit(functools.partial(_read_pages, layout=layout, layers=layers))
        self._write_pages = jax.jit(
            functools.partial(_write_pages, layout=layout, layers=layers), donate_argnums=(0,)
        )
        self._fill = jax.jit(
            functools.partial(fill_program, cfg=cfg, attention=attention), donate_argnums=(1,)
        )
        # the step programs by (tokens, sequences), compiled by `compile_steps`
        self._compiled: dict[tuple[int, int], Callable[..., StepOutputs]] = {}
        self._idle = host_arrays(SamplingParams(temperature=0.0, seed=0), cfg.vocab_size)
        self._host: dict[int, tuple[SamplingParams, SamplingArrays]] = {}  # by device row
        self._last_stack: tuple[list[SamplingArrays], SamplingArrays] | None = None
        # multi-host: called with each call before it runs (the leader's followers)
        self.mirror: Callable[[StepCall], None] | None = None

    def _step_args(self, call: StepCall) -> tuple[object, ...]:
        carry = call.carry
        if carry is None:
            carry = np.full(call.tokens, -1, np.int32)
        return (
            self.params,
            self.pages,
            self.counts,
            self.last,
            call.batch,
            carry,
            call.rows,
            call.emits,
            call.fresh,
            call.sampling,
            call.generated,
            self.eos_mask,
            self.inv_freq,
        )

    def compile_steps(self) -> None:
        """Compile every step program at once, one thread each, kept for `execute`.

        XLA compiles a program on one thread, so on a host of several cores the programs
        compile side by side (a first start's warm-up: seconds each on CPU). One process
        only: over several (engine.multihost) each step's arrays are global and every
        process compiles as it runs them, in the same order."""
        if jax.process_count() > 1:
            return
        idle = StepPlan(())
        calls = {pair: self._call(idle, *pair) for pair in self.shapes.pairs()}

        def build(call: StepCall) -> Callable[..., StepOutputs]:
            return cast(Callable, self._step.lower(*self._step_args(call)).compile())

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            self._compiled = dict(zip(calls, pool.map(build, calls.values()), strict=True))

    def warmup(self) -> None:
        """Compile every program now (before readiness), on padding only, through
        `execute` (so a multi-host leader's followers compile the same, in order)."""
        self.compile_steps()
        idle = StepPlan(())
        for tokens, seqs in self.shapes.pairs():
            self.collect(idle, self.execute(self._call(idle, tokens, seqs)))
        ids = np.full((2, self.max_model_len), self.cfg.vocab_size, np.int32)
        # prompt logprobs, and a rebuilt row once, in a pair of each token bucket (compiled above)
        firsts = [(t, self.shapes.seq_choices(t)[0]) for t in self.shapes.token_buckets]
        if self.shapes.single_row:
            firsts.insert(0, SINGLE_ROW_BUCKET)
        for tokens, seqs in firsts:
            following = np.zeros(tokens, np.int32)
            recount = ((0, ids),) if (tokens, seqs) == firsts[0] else ()
            call = self._call(idle, tokens, seqs, following=following, recount=recount)
            self.collect(idle, self.execute(call))

    def warmup_fill(self) -> None:
        """Compile `fill` for every shape (a draft model's runner)."""
        idle = StepPlan(())
        for tokens, seqs in self.shapes.pairs():
            self.pages = self._fill(
                self.params, self.pages, self._call(idle, tokens, seqs).batch, self.inv_freq
            )
        jax.block_until_ready(self.pages)

    def read_pages(self, ids: Sequence[int]) -> jax.Array:
        """Every layer's pages `ids`, padded to `Shapes.pages_per_seq` (one shape), layer
        by layer along the page axis; returns at once, ordered after the steps dispatched
        before it."""
        table = np.zeros(self.shapes.pages_per_seq, np.int32)
        table[: len(ids)] = ids
        return cast(jax.Array, self._read_pages(self.pages, table))

    def write_pages(self, ids: Sequence[int], blocks: jax.Array) -> None:
        """Blocks from `read_pages` (another mesh's, put on this one by the caller) into
        pages `ids`, in order; the padding past them writes nothing."""
        table = np.full(self.shapes.pages_per_seq, self.layout.num_pages, np.int32)
        table[: len(ids)] = ids
        self.pages = self._write_pages(self.pages, table, blocks)

    def fill(self, plan: StepPlan) -> None:
        """Write the plan's K/V into the pages and nothing else; returns at once."""
        batch = self.prepare(plan).batch
        self.pages = self._fill(self.params, self.pages, batch, self.inv_freq)

    def step(self, plan: StepPlan) -> StepResult:
        """Prepare, run and collect one step (the whole of it, blocking)."""
        return self.collect(plan, self.execute(self.prepare(plan)))

    def prepare(self, plan: StepPlan) -> StepCall:
        """The plan's device work as host arrays, padded to its bucket (host only)."""
        tokens, seqs = self.shapes.bucket(plan.tokens, plan.sample_rows)
        following = None
        if any(r.prompt_next for r in plan.rows):
            following = np.zeros(tokens, np.int32)
            start = 0
            for r in plan.rows:
                following[start : start + len(r.prompt_next)] = r.prompt_next
                start += len(r.chunk.tokens) + len(r.drafts)
        recount = []
        for work in plan.rows:
            if work.prior or work.seen:  # back after a preemption, or a repetition penalty
                ids = np.full((2, self.max_model_len), self.cfg.vocab_size, np.int32)
                ids[0, : len(work.prior)] = work.prior  # what it had sampled: counted
                ids[1, : len(work.seen)] = work.seen  # its prompt: marked seen
                recount.append((work.row, ids))
        return self._call(plan, tokens, seqs, following=following, recount=tuple(recount))

    def _call(
        self,
        plan: StepPlan,
        tokens: int,
        seqs: int,
        *,
        following: np.ndarray | None = None,
        recount: tuple[tuple[int, np.ndarray], ...] = (),
    ) -> StepCall:
        layout = self.layout
        batch = make_batch(
            plan.chunks(),
            tokens=tokens,
            seqs=seqs,
            pages_per_seq=self.shapes.pages_per_seq,
            page_size=layout.page_size,
            num_pages=layout.num_pages,
        )
        if "lora_a_wqkv" in self.params["layers"]:  # adapters served: each token's slot
            batch = dataclasses.replace(batch, lora=plan.lora_slots(tokens))
        real = plan.sample_rows
        rows = np.full(seqs, self.max_num_seqs, np.int32)  # padding: past the table
        emits = np.zeros(seqs, bool)
        fresh = np.zeros(seqs, bool)
        generated = np.zeros(seqs, np.int32)
        per_row = []
        at = 0
        for r in plan.rows:  # a draft's row: the key of the token it stands for, no count
            n = r.sample_rows
            rows[at : at + n] = r.row
            emits[at], fresh[at] = r.emits, r.fresh
            generated[at : at + n] = r.generated + np.arange(n)
            per_row.append(self._sampling(r))
            if r.draft_allowed:
                per_row += [self._sampling(r, mask) for mask in r.draft_allowed]
            else:
                per_row += [per_row[-1]] * (n - 1)
            at += n
        per_row += [self._idle] * (seqs - real)
        carry = None
        if any(r.carry >= 0 for r in plan.rows):
            carry = np.full(tokens, -1, np.int32)
            starts, _ = plan.offsets()
            for start, r in zip(starts, plan.rows, strict=True):
                carry[start] = r.carry
        sampling = self._stacked(per_row)
        return StepCall(batch, rows, emits, fresh, sampling, generated, recount, following, carry)

    def execute(self, call: StepCall) -> Launched:
        """Dispatch the call's programs; returns at once with the outputs on the device."""
        if self.mirror is not None:
            self.mirror(call)
        for row, ids in call.recount:
            self.counts = self._recount(self.counts, np.int32(row), ids[0], ids[1])
        step = self._compiled.get((call.tokens, call.rows.shape[0]), self._step)
        sampled, self.pages, self.counts, self.last, hidden = step(*self._step_args(call))
        prompt = None
        if call.following is not None:
            prompt = self._prompt(self.params, hidden, call.following)
        return Launched(sampled, prompt)

    def collect(self, plan: StepPlan, launched: Launched) -> StepResult:
        """Wait for a launched step and copy what the plan's rows need to the host."""
        real = plan.sample_rows
        sampled = launched.sampled
        logprobs = any(r.sampling.logprobs is not None for r in plan.rows)
        picking = any(r.sampling.logprob_token_ids for r in plan.rows)  # implies logprobs
        fields = sampled[:5] if picking else sampled[: 4 if logprobs else 1]
        host = [np.asarray(a)[:real] for a in jax.device_get(fields)]
        # fields no row asked for are zeros (engine.sampling): only the tokens cross
        host += [np.zeros((real, *a.shape[1:]), a.dtype) for a in sampled[len(host) : 4]]
        picked_logprobs = host[4] if picking else None  # read by the rows naming ids alone
        prompt = None
        if launched.prompt is not None:
            prompt = PromptLogprobs(*(np.asarray(a) for a in launched.prompt))
        starts, sample_rows = plan.offsets()
        tokens, chosen, top_ids, top_logprobs = host[:4]
        return StepResult(
            tokens=tokens,
            logprobs=chosen,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            starts=starts,
            sample_rows=sample_rows,
            prompt=prompt,
            picked_logprobs=picked_logprobs,
        )

    def _stacked(self, per_row: list[SamplingArrays]) -> SamplingArrays:
        """The rows' sampling arrays stacked (host arrays, as jit takes them); the last
        stack again while every row holds the same arrays as then (steady decoding)."""
        last = self._last_stack
        if (
            last is not None
            and len(last[0]) == len(per_row)
            and all(a is b for a, b in zip(last[0], per_row, strict=True))
        ):
            return last[1]
        stacked = [np.stack(field) for field in zip(*per_row, strict=True)]
        sampling = SamplingArrays(*cast(list[jax.Array], stacked))
        self._last_stack = (per_row, sampling)
        return sampling

    def _sampling(self, work: RowWork, allowed: np.ndarray | None = None) -> SamplingArrays:
        """A row's sampling arrays, built once per sequence (the mask changes per step;
        `allowed` is a draft row's)."""
        known = self._host.get(work.row)
        if known is None or known[0] is not work.sampling:
            known = (work.sampling, host_arrays(work.sampling, self.cfg.vocab_size))
            self._host[work.row] = known
        arrays = known[1]
        allowed = work.allowed if allowed is None else allowed
        if allowed is not None:
            mask = cast(jax.Array, allowed)  # host arrays, as jit takes them
            arrays = arrays._replace(allowed=mask, masked=cast(jax.Array, np.bool_(True)))
        return arrays


__all__ = [
    "MAX_LOGPROBS",
    "Chunk",
    "PromptLogprobs",
    "RowWork",
    "Runner",
    "StepPlan",
    "StepCall",
    "StepResult",
    "prompt_logprobs_program",
    "step_program",
]
