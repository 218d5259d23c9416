"""Ahead-of-time compilation of the engine's programs for a TPU topology, on any machine.

Run: `python -m bench.tpu_aot --config 1b --topology v5e:2x2 --tensor-parallel-size 1
--max-num-seqs 64 --max-model-len 4096 --json out.json` (needs libtpu: `pip install
"jax[tpu]==0.10.2"`; no TPU). Writes `{"setup": ..., "programs": [...]}`, one entry per
program and batch with name, kind, batch (sequences), tokens, sampling ("greedy" or
"sampled"), contexts ("full" or "mixed"), kv_positions (the positions its sequences
attend over, summed), compiled, error, compile_s, peak_bytes_per_chip,
hbm_bytes_per_chip, bytes_accessed, unavoidable_bytes, ratio, flops, unavoidable_flops,
roofline_s, unavoidable_roofline_s, time_ratio and bound ("hbm" or "flops"), every
figure per chip; a prompt's program adds once_unavoidable_bytes, once_roofline_s and
once_time_ratio (against one pass over the weights for the whole prompt). A step also
gives bias_mask_bytes and bias_mask_flops (what its figure counts for the logit-bias and
allowed-token branches) and plain_bytes_accessed, plain_flops, plain_roofline_s,
plain_time_ratio, plain_bound (and a prompt's plain_once_time_ratio): the same figures
for a batch that takes neither branch.

Programs, each the engine core's own (engine.core.runner) with abstract params in the
checkpoint's layout and the engine's shardings, the TPU's attention and sampler:
- the step (`step_program`: the ragged batch through the model, the head,
  sampling and the penalty counts' update, its tokens read from the step before where
  carried): `decode-N` for 1, 8 and max_num_seqs sequences, each at the context the
  pages allow ("full") and at contexts spread evenly over 1..that ("mixed"), greedy and
  sampled; a 1,024-token prompt in `--chunk`-token chunks (`prefill`, summed over its
  chunks); and `mixed` (max_num_seqs - 1 decode rows beside one chunk);
- `prompt-logprobs` over one chunk's hidden states.

Each program is compiled once, as the server compiles it (its sampling arrays are
arguments) but for memory-space assignment, which is off by default: every array lives
in HBM, so XLA's cost analysis counts HBM traffic only (with it on, a weight staged into
VMEM is counted when copied in and again when read), an upper bound on the real
program's, and the peak it reports bounds the real program's HBM.
`--memory-space-assignment` compiles with the server's options instead; bytes_accessed
is then HBM's alone: XLA's count (xla_bytes_accessed) less what it counts of arrays
outside HBM (on_chip_bytes, read off the program's memory spaces by bench.tpu_hlo), so
an array in VMEM counts nothing where it is read or written, a copy between HBM and
VMEM counts its HBM end once, and everything in HBM keeps XLA's own count.

XLA counts each `cond` at its costliest branch, so one figure serves every batch of that
shape: a greedy batch and a sampled one (temperature 0.7, top-p 0.9, top-k 50, a
presence penalty, logprobs 5) read the same figure, which also counts the logit-bias and
allowed-token branches neither takes. The plain_* figures leave those two out, from the
same compiled program: bench.tpu_hlo counts it again with each conditional branch in
their named scopes (engine.sampling_tpu.BIAS_SCOPE, MASK_SCOPE) not taken, and their
FLOPs (a few passes of elementwise work over the logits) are XLA's for each branch
compiled alone over the step's logits. XLA cannot see into the Pallas attention kernel;
bench.tpu_roofline.kernel_work adds what it moves and computes by its block rules
(engine.attention.tpu.kernel_calls).
unavoidable_bytes: the weights a step must read on the chip (an untied embedding only
its gathered rows; a tied one is the head), each sequence's live K/V read once, and the
new K/V written; unavoidable_flops: bench.tpu_roofline.useful_flops. roofline_s:
max(flops / peak FLOP/s, bytes / HBM bandwidth) a step, summed over a prompt's chunks
(the chip's peaks: bench.tpu_roofline.CHIP_PEAKS, or `--chip-peaks`).

`--num-pages memory` sizes the pool as the engine does on a chip (engine.core.memory:
0.9 of HBM less the temporaries' headroom and the weights).
`--lora` compiles the step with a LoRA pool beside every layer (engine.lora: `--max-loras`
slots, default 4, of `--max-lora-rank`, default 16, each token's slot an argument), and
compiles each program again without it: `lora_over_base` gives each program's bytes
accessed against the base program's (bench/README.md, "LoRA").
`--quantization int8` compiles against int8 weights with their scales (engine.quant) and
`--kv-cache-dtype fp8` against fp8 pages (engine.attention.kv_dtype): unavoidable_bytes
then counts those bytes, so bytes_accessed against a bfloat16 run of the same setup is
what quantization saves (bench/README.md, "Quantization").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU devices below are descriptions only
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is opened: runs may overlap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bench.model_shapes import CONFIGS, checkpoint_shapes, model_config
from bench.tpu_hlo import traffic
from bench.tpu_report import GIB, Counted, Program, summary
from bench.tpu_roofline import (
    CHIP_PEAKS,
    Peaks,
    StepShape,
    Work,
    attention_flops,
    kernel_work,
    matmul_elements,
    ratio,
    spread,
    useful_flops,
)
from engine.attention import AttentionBatch, KVLayout
from engine.attention.kv_dtype import KV_CACHE_DTYPES, storage_dtype
from engine.attention.tpu import PallasAttention
from engine.core.core import CHUNK_SIZE, backend_numerics
from engine.core.memory import TEMPORARY_HEADROOM, KVBudget
from engine.core.runner import prompt_logprobs_program, step_program
from engine.core.shapes import Shapes
from engine.lora import LoraConfig, pool_shapes, pool_sharding
from engine.mesh import MODEL_AXIS, checkpoint_param_shardings
from engine.paged_model import StepBatch
from engine.quant import QUANTIZATIONS, quantized_shapes
from engine.sampling import SamplingArrays, add_logit_bias
from engine.sampling_tpu import BIAS_SCOPE, MASK_SCOPE, apply_token_bitmask, backend_sampler
from engine.token_mask import mask_words
from engine.types import MAX_LOGIT_BIAS, MAX_LOGPROB_TOKEN_IDS

# XLA's memory-space assignment for v5e/v5p ("vf") and v6e ("gf") off: every array stays
# in HBM, so the cost analysis counts HBM traffic only (see the module docstring).
HBM_ONLY: dict[str, str | bool] = {
    "xla_vf_vmem_memory_space_assignment": False,
    "xla_gf_vmem_memory_space_assignment": False,
}
# HBM per chip (public specifications): what the programs and the KV pages must fit.
HBM_BYTES = {"TPU v5 lite": 16 * GIB, "TPU v6 lite": 32 * GIB, "TPU v5": 95 * GIB}
PROMPT = 1024  # the prefill program's prompt
DEFAULT_PAGE_SIZE = 16  # the server's (server.config.ServerConfig.page_size)
SAMPLINGS = ("greedy", "sampled")


@dataclass(frozen=True)
class Setup:
    config: str
    topology: str
    tensor_parallel_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    layers: int | None
    dtype: str
    page_size: int
    num_pages: int
    chunk: int
    quantization: str = "none"  # engine.quant: "int8" weights
    kv_cache_dtype: str = "auto"  # engine.attention.kv_dtype
    chip_peaks: str | None = None  # "FLOPS,BYTES_PER_S"; default: CHIP_PEAKS
    max_loras: int = 0  # engine.lora: a pool of this many adapter slots (0: no LoRA)
    max_lora_rank: int = 16
    # XLA's memory-space assignment on, as the server compiles: bytes are HBM's alone
    # (bench.tpu_hlo), XLA's own count of every memory space beside them
    memory_space_assignment: bool = False


def placed(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def stacked_shapes(params: Any) -> Any:
    """Params' shapes with the layers stacked as the runner stacks them
    (engine.paged_model.stack_layers): a leading layer axis, unsplit."""

    def stack(*leaves: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        one = leaves[0]
        sharding = NamedSharding(one.sharding.mesh, PartitionSpec(None, *one.sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *one.shape), one.dtype, sharding=sharding)

    return {**params, "layers": jax.tree.map(stack, *params["layers"])}


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of abstract arrays with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def sampling_shapes(rows: int, vocab: int, mesh: Mesh) -> SamplingArrays:
    whole = NamedSharding(mesh, PartitionSpec())

    def a(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

    f, i = jnp.float32, jnp.int32
    return SamplingArrays(
        temperature=a((rows,), f),
        top_k=a((rows,), i),
        top_p=a((rows,), f),
        presence_penalty=a((rows,), f),
        frequency_penalty=a((rows,), f),
        repetition_penalty=a((rows,), f),
        min_tokens=a((rows,), i),
        key=a((rows, 2), jnp.uint32),
        logprobs=a((rows,), bool),
        bias_ids=a((rows, MAX_LOGIT_BIAS), i),
        bias_values=a((rows, MAX_LOGIT_BIAS), f),
        allowed=a((rows, mask_words(vocab)), i),
        masked=a((rows,), bool),
        picked_ids=a((rows, MAX_LOGPROB_TOKEN_IDS), i),
    )


@dataclass(frozen=True)
class Sequences:
    """A ragged batch's shape: each sequence's query count and length after the step."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


class Harness:
    """Compiles and measures the programs of one setup."""

    def __init__(self, setup: Setup) -> None:
        from jax.experimental import topologies

        self.setup = setup
        devices = topologies.get_topology_desc(platform="tpu", topology_name=setup.topology).devices
        tp = setup.tensor_parallel_size
        if tp > len(devices):
            raise ValueError(f"{setup.topology} has {len(devices)} chips, not {tp}")
        self.mesh = Mesh(np.array(devices[:tp]), (MODEL_AXIS,))
        self.device_kind = devices[0].device_kind
        self.hbm = HBM_BYTES.get(self.device_kind, 0)
        if setup.chip_peaks is not None:
            self.peaks = Peaks.parse(setup.chip_peaks)
        elif self.device_kind in CHIP_PEAKS:
            self.peaks = Peaks(*CHIP_PEAKS[self.device_kind])
        else:
            raise ValueError(f"no peaks known for {self.device_kind}: pass --chip-peaks")
        self.cfg = backend_numerics(model_config(setup.config, setup.layers, tp), "tpu")
        self.dtype = jnp.dtype(setup.dtype)
        self.whole = NamedSharding(self.mesh, PartitionSpec())
        fold = 128 // self.cfg.head_dim if self.cfg.head_dim < 128 else 1
        shapes = checkpoint_shapes(self.cfg, self.dtype, slot_layout=False)
        self.params = placed(shapes, checkpoint_param_shardings(shapes, self.cfg, self.mesh))
        if setup.quantization == "int8":
            self.params = quantized_shapes(self.params)
        if setup.max_loras:  # the LoRA pool beside each layer's weights, split as they are
            pool = pool_shapes(self.cfg, LoraConfig(setup.max_loras, setup.max_lora_rank))
            self.params["layers"] = [
                lp | {k: jax.ShapeDtypeStruct(s, self.dtype, sharding=pool_sharding(self.mesh, k))
                      for k, s in pool.items()}
                for lp in self.params["layers"]
            ]  # fmt: skip
        kv_dtype = storage_dtype(setup.kv_cache_dtype, setup.dtype)
        probe = KVLayout(
            1, setup.page_size, self.cfg.num_kv_heads, self.cfg.head_dim, kv_dtype, fold
        )
        if setup.num_pages <= 0:  # memory-sized, as engine.core.memory sizes the pool
            usable = int(self.hbm * (KVBudget().memory_utilization - TEMPORARY_HEADROOM))
            page = probe.page_bytes * self.cfg.num_layers // tp
            setup = self.setup = replace(
                setup, num_pages=(usable - per_chip_bytes(self.params)) // page
            )
        self.layout = replace(probe, num_pages=setup.num_pages)
        stacked = self.layout.stacked(self.cfg.num_layers)  # as the runner keeps them
        self.attention = PallasAttention(stacked, self.mesh)
        pages_sharding = NamedSharding(self.mesh, PartitionSpec(None, None, MODEL_AXIS, None))
        self.pages = jax.ShapeDtypeStruct(
            stacked.shape, stacked.array_dtype, sharding=pages_sharding
        )
        self.params = stacked_shapes(self.params)
        self.pages_per_seq = -(-setup.max_model_len // setup.page_size)
        self.shapes = Shapes.of(
            setup.max_num_seqs, setup.max_num_batched_tokens, self.pages_per_seq
        )
        self.programs: list[Program] = []
        self._branch_flops: dict[int, float] = {}

    # -- what a step must do, per chip ------------------------------------------------
    def kv_token_bytes(self) -> int:
        """One position's K and V in every layer, on one chip (unpadded)."""
        per_chip = self.cfg.num_kv_heads // self.setup.tensor_parallel_size
        return per_chip * self.layout.token_bytes // self.layout.kv_heads * self.cfg.num_layers

    def weight_bytes(self, params: Any, tokens: int) -> float:
        total = per_chip_bytes(params)
        if "lm_head" in params and not self.cfg.tie_word_embeddings:
            embed = params["embed"]
            total -= per_chip_bytes(embed)  # only the gathered rows are read
            total += tokens * self.cfg.hidden_size * np.dtype(embed.dtype).itemsize
        return float(total)

    def shape(self, seqs: Sequences) -> StepShape:
        tp = self.setup.tensor_parallel_size
        return StepShape(
            self.cfg.num_layers,
            self.cfg.num_heads // tp,
            self.cfg.head_dim,
            seqs.q_lens,
            seqs.kv_lens,
        )

    def unavoidable(self, seqs: Sequences) -> Work:
        """The weights once, each sequence's live K/V once, the new K/V written; useful
        FLOPs (bench.tpu_roofline.useful_flops)."""
        live = sum(seqs.kv_lens) - sum(seqs.q_lens)  # positions read before the step
        new = sum(seqs.q_lens)
        moved = self.weight_bytes(self.params, new) + (live + new) * self.kv_token_bytes()
        stacked = self.params["layers"]  # a leading layer axis: a matrix has three
        layers = matmul_elements(stacked, min_axes=3)
        if self.setup.max_loras:  # a token multiplies by its one adapter's slot
            pools = {k: v for k, v in stacked.items() if k.startswith("lora_")}
            layers -= (
                matmul_elements(pools, min_axes=3)
                * (self.setup.max_loras - 1)
                // self.setup.max_loras
            )
        head = matmul_elements(self.params.get("lm_head", self.params["embed"]))
        return Work(moved, useful_flops(layers, head, self.shape(seqs)))

    def kernel(self, seqs: Sequences, tokens: int) -> Work:
        """What the Pallas kernel moves and computes, per chip, over all layers."""
        return kernel_work(
            self.layout,
            self.shape(seqs),
            tokens,
            self.pages_per_seq,
            self.setup.tensor_parallel_size,
            self.dtype.itemsize,
        )

    def full_context(self, count: int) -> int:
        """Each of `count` busy sequences as long as the pages hold, at most max_model_len."""
        setup = self.setup
        return min(setup.max_model_len, setup.num_pages // count * setup.page_size)

    # -- compiling --------------------------------------------------------------------
    @property
    def options(self) -> dict[str, str | bool]:
        """The compiler options: the server's, or memory-space assignment off."""
        return {} if self.setup.memory_space_assignment else HBM_ONLY

    def _counted(self, compiled: Any, rows: int | None = None) -> Counted:
        """A compiled program's bytes and FLOPs: XLA's cost analysis; with memory-space
        assignment on, its bytes less those it counts of arrays outside HBM (bench.tpu_hlo:
        an array staged into VMEM counts its copy's HBM end once; one that never leaves
        VMEM counts nothing). `rows`: a step's sequences, whose logit-bias and
        allowed-token branches are `untaken`."""
        cost = compiled.cost_analysis()
        xla = Work(float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0)))
        moved = traffic(compiled.as_text(), (BIAS_SCOPE, MASK_SCOPE) if rows is not None else ())
        flops = self.branch_flops(rows) if rows is not None else 0.0
        if not self.setup.memory_space_assignment:
            untaken = Work(moved.all_spaces - moved.plain_all_spaces, flops)
            return Counted(xla, untaken=untaken)
        untaken = Work(moved.hbm - moved.plain_hbm, flops)
        hbm = Work(xla.bytes - moved.on_chip, xla.flops)
        return Counted(hbm, xla.bytes, moved.on_chip, untaken)

    def _compile(
        self,
        programs: Sequence[Program],
        fn: Callable[..., Any],
        args: Sequence[Any],
        donate: tuple[int, ...],
        rows: int | None = None,
    ) -> Counted | None:
        """Compiles `fn` once, with the server's options or memory-space assignment off
        (module docstring); records on each of `programs` whether it compiled and fits.
        Returns its bytes and FLOPs (`_counted`)."""
        start = time.perf_counter()
        error = None
        try:
            with jax.default_device(self.mesh.devices.flat[0]):  # Pallas asks the device kind
                lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
                compiled = lowered.compile(compiler_options=self.options)
        except Exception as exc:  # a program that does not compile is a result
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
        seconds = round(time.perf_counter() - start, 2)
        peak = 0
        if error is None:
            memory = compiled.memory_analysis()
            peak = int(
                memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes
            )
            if self.hbm and peak > self.hbm:
                error = f"needs {peak} bytes of {self.hbm} per chip"
        for program in programs:
            program.compile_s, program.error = seconds, error
            program.compiled = peak > 0
            program.peak_bytes_per_chip, program.hbm_bytes_per_chip = peak, self.hbm
        if error is not None:
            return None
        return self._counted(compiled, rows)

    def branch_flops(self, rows: int) -> float:
        """XLA's FLOPs of the logit-bias and allowed-token branches over a step's `rows`
        float32 logits as the step holds them (a vocabulary shard a chip where the head is
        split), each compiled alone: elementwise work and one small product, the same
        whatever fuses around them (their bytes are the step's own: bench.tpu_hlo)."""
        if rows not in self._branch_flops:
            vocab = self.cfg.vocab_size
            split = PartitionSpec(None, MODEL_AXIS) if self.cfg.head_shards > 1 else PartitionSpec()
            arrays = sampling_shapes(rows, vocab, self.mesh)
            logits = jax.ShapeDtypeStruct(
                (rows, vocab), jnp.float32, sharding=NamedSharding(self.mesh, split)
            )
            branches = (
                (add_logit_bias, (logits, arrays.bias_ids, arrays.bias_values)),
                (apply_token_bitmask, (logits, arrays.allowed)),
            )
            total = 0.0
            with jax.default_device(self.mesh.devices.flat[0]):
                for fn, args in branches:
                    compiled = jax.jit(fn).lower(*args).compile(compiler_options=self.options)
                    total += float(compiled.cost_analysis().get("flops", 0.0))
            self._branch_flops[rows] = total
        return self._branch_flops[rows]

    def _batch(self, count: int, tokens: int) -> StepBatch:

        def a(*shape: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.whole)

        return StepBatch(
            tokens=a(tokens),
            positions=a(tokens),
            slots=a(tokens),
            attention=AttentionBatch(a(count), a(count, self.pages_per_seq), a(count + 1), a(1)),
            last=a(count),
            lora=a(tokens) if self.setup.max_loras else None,
        )

    def step_args(self, count: int, tokens: int) -> tuple[Any, ...]:
        """The step's arguments as the runner passes them, for a (tokens, count) bucket."""
        vocab = self.cfg.vocab_size
        whole = self.whole

        def ints(*shape: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

        return (
            self.params,
            self.pages,
            ints(self.setup.max_num_seqs, vocab),  # penalty counts per device row
            ints(self.setup.max_num_seqs),  # the step before's sampled tokens
            self._batch(count, tokens),
            ints(tokens),  # carry: which tokens read them
            ints(count),  # rows
            ints(count, dtype=bool),  # emits
            ints(count, dtype=bool),  # fresh
            sampling_shapes(count, vocab, self.mesh),
            ints(count),  # generated
            ints(vocab, dtype=bool),  # eos mask
            jax.ShapeDtypeStruct((self.cfg.head_dim // 2,), jnp.float32, sharding=whole),
        )

    def paged(
        self, name: str, kind: str, variants: Sequence[tuple[str, str, Sequence[Sequences]]]
    ) -> list[Program]:
        """The step compiled once for the bucket of the variants' batches (each variant:
        its sampling, its contexts and its steps, in turn: a prompt's chunks, one step
        otherwise); one Program per variant. XLA's figures are the compiled program's;
        the kernel's and the unavoidable work are each batch's own."""
        first = variants[0][2][0]
        real = sum(first.q_lens)
        programs = [
            Program(
                name,
                kind,
                batch=len(first.q_lens),
                tokens=real * len(steps),
                sampling=sampling,
                contexts=contexts,
                kv_positions=sum(sum(step.kv_lens) for step in steps),
            )
            for sampling, contexts, steps in variants
        ]
        # the bucket the runner pads this batch to (padding sequences read no pages)
        tokens, count = self.shapes.bucket(real, len(first.q_lens))
        step = functools.partial(
            step_program, cfg=self.cfg, attention=self.attention, sampler=backend_sampler("tpu")
        )
        xla = self._compile(programs, step, self.step_args(count, tokens), (1, 2, 3), count)
        if xla is not None:
            for program, (_, _, steps) in zip(programs, variants, strict=True):
                useful = 0.0
                for part in steps:
                    kernel = self.kernel(part, tokens)
                    program.add(xla.plus(kernel), self.unavoidable(part), self.peaks)
                    program.kernel_flops += kernel.flops
                    useful += attention_flops(self.shape(part))
                program.attention_flops_ratio = ratio(program.kernel_flops, useful)
        self.programs.extend(programs)
        return programs

    def prompt_logprobs(self, tokens: int) -> Program:
        """The prompt-logprobs program over one step's hidden states (engine.core.runner):
        the head over every token, a log-softmax, the chosen and the best logprobs."""
        program = Program(f"prompt-logprobs-{tokens}", "prompt-logprobs", 1, tokens, None)
        whole = self.whole
        args = (
            self.params,
            jax.ShapeDtypeStruct((tokens, self.cfg.hidden_size), self.dtype, sharding=whole),
            jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=whole),
        )
        fn = functools.partial(prompt_logprobs_program, cfg=self.cfg)
        xla = self._compile([program], fn, args, ())
        if xla is not None:
            head = self.params.get("lm_head", self.params["embed"])
            must = per_chip_bytes(head) + tokens * self.cfg.hidden_size * self.dtype.itemsize
            useful = 2.0 * tokens * matmul_elements(head)
            program.add(xla, Work(float(must), useful), self.peaks)
        self.programs.append(program)
        return program

    def run(self, which: Sequence[str]) -> list[Program]:
        setup = self.setup
        n, chunk = setup.max_num_seqs, setup.chunk
        if "decode" in which:
            for count in sorted({c for c in (1, 8, n) if c <= n}):
                full = self.full_context(count)
                batches = {
                    "full": Sequences((1,) * count, (full,) * count),
                    "mixed": Sequences((1,) * count, spread(full, count)),
                }
                variants = [
                    (sampling, contexts, [seqs])
                    for sampling in SAMPLINGS
                    for contexts, seqs in batches.items()
                ]
                self.paged(f"decode-{count}", "decode", variants)
        if "prefill" in which:
            ends = range(chunk, PROMPT + 1, chunk)
            steps = [Sequences((chunk,), (end,)) for end in ends]
            (program,) = self.paged(f"prefill-{PROMPT}", "prefill", [("sampled", "full", steps)])
            if program.compiled:
                program.once(self.weight_bytes(self.params, chunk), len(steps), self.peaks)
        if "mixed" in which:
            held = self.full_context(n)
            q_lens = (1,) * (n - 1) + (chunk,)
            seqs = Sequences(q_lens, (held,) * (n - 1) + (PROMPT,))
            self.paged(f"mixed-{n}", "mixed", [("sampled", "full", [seqs])])
        if "prompt-logprobs" in which:
            self.prompt_logprobs(chunk)
        return self.programs


def over_base(lora: Sequence[Program], base: Sequence[Program]) -> list[dict[str, Any]]:
    """Each LoRA program's bytes accessed (per chip) beside the same program's without
    the pool: name, sampling, contexts, both byte counts and their ratio."""
    plain = {(p.name, p.sampling, p.contexts): p for p in base}
    out = []
    for p in lora:
        b = plain[(p.name, p.sampling, p.contexts)]
        out.append(
            {
                "name": p.name,
                "sampling": p.sampling,
                "contexts": p.contexts,
                "bytes_accessed": p.bytes_accessed,
                "base_bytes_accessed": b.bytes_accessed,
                "over_base": ratio(p.bytes_accessed, b.bytes_accessed),
            }
        )
    return out


def default_pages(setup_args: argparse.Namespace) -> int:
    """--num-pages: a count; "memory": what the chip's HBM holds beside the weights (0
    here, sized by the Harness); default: max_num_seqs sequences of max_model_len, one
    spare page each."""
    if setup_args.num_pages == "memory":
        return 0
    if setup_args.num_pages is not None:
        return int(setup_args.num_pages)
    per_seq = -(-setup_args.max_model_len // setup_args.page_size)
    return setup_args.max_num_seqs * per_seq + setup_args.max_num_seqs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: a chunk + every row"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers: a faster run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument(
        "--num-pages", default=None, help='a count, or "memory"; default: every sequence full'
    )
    parser.add_argument(
        "--chip-peaks", default=None, help="FLOPS,BYTES_PER_S of a chip (default: its own)"
    )
    parser.add_argument(
        "--chunk", type=int, default=CHUNK_SIZE["tpu"], help="prompt tokens per step"
    )
    parser.add_argument(
        "--programs",
        default="decode,prefill,mixed,prompt-logprobs",
        help="of decode,prefill,mixed,prompt-logprobs",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="the step with a LoRA pool (--max-loras slots of --max-lora-rank), and each "
        "program's bytes over the same program without it",
    )
    parser.add_argument(
        "--memory-space-assignment",
        action="store_true",
        help="compile as the server does (XLA's memory-space assignment on) and count HBM's "
        "bytes alone from the program's memory spaces (bench.tpu_hlo)",
    )
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    setup = Setup(
        config=args.config,
        topology=args.topology,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens or args.chunk + args.max_num_seqs,
        layers=args.layers,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=default_pages(args),
        chunk=args.chunk,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        chip_peaks=args.chip_peaks,
        max_loras=args.max_loras if args.lora else 0,
        max_lora_rank=args.max_lora_rank,
        memory_space_assignment=args.memory_space_assignment,
    )
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # TPU programs cannot load here
    try:
        harness = Harness(setup)
        programs = harness.run(args.programs.split(","))
        base = (
            Harness(replace(setup, max_loras=0)).run(args.programs.split(",")) if args.lora else []
        )
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    report = {
        "setup": dataclasses.asdict(harness.setup)
        | {"device_kind": harness.device_kind, "peaks": dataclasses.asdict(harness.peaks)},
        "programs": [dataclasses.asdict(p) for p in programs],
    }
    if args.lora:
        report["lora_over_base"] = over_base(programs, base)
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    for p in programs:
        print(summary(p), file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
