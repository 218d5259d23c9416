"""Ahead-of-time compilation of the engine's programs for a TPU topology, on any machine.

Run: `python -m bench.tpu_aot --config 1b --topology v5e:2x2 --tensor-parallel-size 1
--max-num-seqs 64 --max-model-len 4096 --json out.json` (needs libtpu: `pip install
"jax[tpu]==0.10.2"`; no TPU). Writes `{"setup": ..., "programs": [...]}`, one entry per
program with name, kind, batch (sequences), tokens, compiled, error, compile_s,
peak_bytes_per_chip, hbm_bytes_per_chip, bytes_accessed, unavoidable_bytes and ratio,
every figure per chip.

Programs, each the engine core's own (engine.core.runner) with abstract params in the
checkpoint's layout and the engine's shardings:
- the step (`step_program`: the ragged batch through the model, the head,
  sampling and the penalty counts' update, its tokens read from the step before where
  carried): `decode` with every sequence busy as long as the pages
  allow and with one at max_model_len, a 1,024-token prompt in `--chunk`-token chunks
  (`prefill`, bytes summed over its chunks), and `mixed` (max_num_seqs - 1 decode rows
  beside one chunk);
- `prompt-logprobs` over one chunk's hidden states.

bytes_accessed: HBM traffic. The step is compiled once as the server runs it (whether
it compiles and fits: peak bytes per chip against the chip's HBM), then once more with
a greedy batch's sampling arrays as constants, so that every sampling `cond` keeps the
branch such a batch takes (XLA's analysis of a `cond` counts its costliest branch: the
top-p bisection no greedy step runs), and with memory-space assignment off, so that
every array lives in HBM and the analysis counts HBM traffic only (an upper bound:
the real program keeps some of it in VMEM). XLA cannot see into the Pallas attention
kernel: for each block of its queries, each sequence in it reads its pages in whole
blocks of engine.attention.tpu.kv_pages_per_block pages (the kernel copies whole
blocks), plus its queries and outputs; that is added. xla_bytes_accessed is XLA's own
figure of the real program plus the same kernel bytes: VMEM traffic included, every
cond at its costliest branch. unavoidable_bytes: the weights a step must read on the
chip (an untied embedding only its gathered rows; a tied one is the head), each
sequence's live K/V read once, and the new K/V written. ratio: bytes_accessed over
unavoidable_bytes.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU devices below are descriptions only
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is opened: runs may overlap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bench.model_shapes import CONFIGS, checkpoint_shapes, model_config
from engine.attention import AttentionBatch, KVLayout
from engine.attention.kv_dtype import KV_CACHE_DTYPES, storage_dtype
from engine.attention.tpu import PallasAttention, kv_pages_per_block, queries_per_block
from engine.core.core import backend_numerics
from engine.core.runner import Shapes, prompt_logprobs_program, step_program
from engine.mesh import MODEL_AXIS, checkpoint_param_shardings
from engine.paged_model import StepBatch
from engine.quant import QUANTIZATIONS, quantized_shapes
from engine.sampling import SamplingArrays, host_arrays
from engine.token_mask import mask_words
from engine.types import MAX_LOGIT_BIAS, SamplingParams

GIB = 1 << 30
# XLA's memory-space assignment for v5e/v5p ("vf") and v6e ("gf") off: every array stays
# in HBM, so the cost analysis counts HBM traffic only (see the module docstring).
HBM_ONLY = {
    "xla_vf_vmem_memory_space_assignment": False,
    "xla_gf_vmem_memory_space_assignment": False,
}
# HBM per chip (public specifications): what the programs and the KV pages must fit.
HBM_BYTES = {"TPU v5 lite": 16 * GIB, "TPU v6 lite": 32 * GIB, "TPU v5": 95 * GIB}
PROMPT = 1024  # the prefill program's prompt
DEFAULT_PAGE_SIZE = 128


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


@dataclass
class Program:
    name: str
    kind: str
    batch: int
    tokens: int
    compiled: bool = False
    error: str | None = None
    compile_s: float = 0.0
    peak_bytes_per_chip: int = 0
    hbm_bytes_per_chip: int = 0
    bytes_accessed: float = 0.0  # HBM traffic of a greedy batch's step + the kernel's
    unavoidable_bytes: float = 0.0
    ratio: float | None = None
    xla_bytes_accessed: float = 0.0  # XLA's own figure (module docstring)

    def add(self, hbm: float, xla: float, kernel: float, unavoidable: float) -> None:
        """One step's figures (a prompt's chunks add theirs in turn)."""
        self.bytes_accessed += hbm + kernel
        self.xla_bytes_accessed += xla + kernel
        self.unavoidable_bytes += unavoidable
        self.ratio = round(self.bytes_accessed / self.unavoidable_bytes, 3)


def placed(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


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
        min_tokens=a((rows,), i),
        key=a((rows, 2), jnp.uint32),
        logprobs=a((rows,), bool),
        bias_ids=a((rows, MAX_LOGIT_BIAS), i),
        bias_values=a((rows, MAX_LOGIT_BIAS), f),
        allowed=a((rows, mask_words(vocab)), i),
        masked=a((rows,), bool),
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
        self.cfg = backend_numerics(model_config(setup.config, setup.layers, tp), "tpu")
        self.dtype = jnp.dtype(setup.dtype)
        self.whole = NamedSharding(self.mesh, PartitionSpec())
        fold = 128 // self.cfg.head_dim if self.cfg.head_dim < 128 else 1
        self.layout = KVLayout(
            setup.num_pages,
            setup.page_size,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            storage_dtype(setup.kv_cache_dtype, setup.dtype),
            fold,
        )
        self.attention = PallasAttention(self.layout, self.mesh)
        shapes = checkpoint_shapes(self.cfg, self.dtype, slot_layout=False)
        self.params = placed(shapes, checkpoint_param_shardings(shapes, self.cfg, self.mesh))
        if setup.quantization == "int8":
            self.params = quantized_shapes(self.params)
        pages_sharding = NamedSharding(self.mesh, PartitionSpec(None, None, MODEL_AXIS, None))
        layout = self.layout
        one = jax.ShapeDtypeStruct(layout.shape, layout.array_dtype, sharding=pages_sharding)
        self.pages = tuple(one for _ in range(self.cfg.num_layers))
        self.pages_per_seq = -(-setup.max_model_len // setup.page_size)
        self.shapes = Shapes.of(
            setup.max_num_seqs, setup.max_num_batched_tokens, self.pages_per_seq
        )
        self.programs: list[Program] = []

    # -- what a step must move, per chip ------------------------------------------------
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

    def unavoidable(self, params: Any, seqs: Sequences) -> float:
        live = sum(seqs.kv_lens) - sum(seqs.q_lens)  # positions read before the step
        new = sum(seqs.q_lens)
        return self.weight_bytes(params, new) + (live + new) * self.kv_token_bytes()

    def kernel_bytes(self, seqs: Sequences, tokens: int) -> float:
        """What the Pallas kernel moves, per chip, over all layers (module docstring)."""
        layout, tp = self.layout, self.setup.tensor_parallel_size
        block = kv_pages_per_block(layout, self.pages_per_seq)
        per_q = queries_per_block(tokens)
        page = layout.page_bytes // tp
        pages = 0
        start = 0
        for q_len, kv_len in zip(seqs.q_lens, seqs.kv_lens, strict=True):
            q_blocks = len(range(start // per_q, (start + q_len - 1) // per_q + 1))
            needed = -(-kv_len // layout.page_size)
            pages += q_blocks * (-(-needed // block)) * block
            start += q_len
        heads = self.cfg.num_heads // tp
        q_and_out = 2 * tokens * heads * layout.lanes * self.dtype.itemsize
        return float((pages * page + q_and_out) * self.cfg.num_layers)

    # -- compiling --------------------------------------------------------------------
    def _compile(
        self,
        program: Program,
        fn: Callable[..., Any],
        args: Sequence[Any],
        donate: tuple[int, ...],
        greedy: Callable[..., Any],
        greedy_args: Sequence[Any],
    ) -> tuple[float, float] | None:
        """Compiles `fn` as the server does, records whether it compiled and fits, then
        compiles `greedy` (the same step with a greedy batch's sampling arrays as
        constants, so each sampling cond keeps only the branch such a batch takes) with
        every array in HBM. Returns (that one's bytes accessed, XLA's figure of `fn`)."""
        start = time.perf_counter()
        try:
            with jax.default_device(self.mesh.devices.flat[0]):  # Pallas asks the device kind
                compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        except Exception as exc:  # a program that does not compile is a result
            program.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
            program.compile_s = round(time.perf_counter() - start, 2)
            return None
        program.compile_s = round(time.perf_counter() - start, 2)
        program.compiled = True
        memory = compiled.memory_analysis()
        program.hbm_bytes_per_chip = self.hbm
        program.peak_bytes_per_chip = int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
        if self.hbm and program.peak_bytes_per_chip > self.hbm:
            program.error = f"needs {program.peak_bytes_per_chip} bytes of {self.hbm} per chip"
            return None
        with jax.default_device(self.mesh.devices.flat[0]):
            lowered = jax.jit(greedy, donate_argnums=donate).lower(*greedy_args)
            traffic = lowered.compile(compiler_options=HBM_ONLY)
        return _bytes_accessed(traffic), _bytes_accessed(compiled)

    def _batch(self, count: int, tokens: int) -> StepBatch:

        def a(*shape: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.whole)

        return StepBatch(
            tokens=a(tokens),
            positions=a(tokens),
            slots=a(tokens),
            attention=AttentionBatch(a(count), a(count, self.pages_per_seq), a(count + 1), a(1)),
            last=a(count),
        )

    def paged(self, name: str, kind: str, seqs: Sequences, repeat: int = 1) -> Program:
        """The step for this ragged batch; `repeat` > 1 sums consecutive chunks of one
        prompt (seqs then lists their kv_lens in turn, one sequence each)."""
        steps = [
            Sequences(seqs.q_lens, seqs.kv_lens)
            if repeat == 1
            else Sequences((seqs.q_lens[0],), (kv,))
            for kv in (seqs.kv_lens if repeat > 1 else (0,))
        ]
        first = steps[0]
        real = sum(first.q_lens)
        program = Program(name, kind, batch=len(first.q_lens), tokens=real * len(steps))
        # the bucket the runner pads this batch to (padding sequences read no pages)
        tokens, count = self.shapes.bucket(real, len(first.q_lens))
        vocab = self.cfg.vocab_size
        whole = self.whole

        def ints(*shape: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

        args = (
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
        step = functools.partial(step_program, cfg=self.cfg, attention=self.attention)
        greedy = host_arrays(SamplingParams(temperature=0.0, seed=0), vocab)
        sampling = SamplingArrays(*(np.stack([a] * count) for a in greedy))

        generated = np.zeros((count,), np.int32)

        def greedy_step(*abstract: Any) -> Any:
            *lead, eos, inv_freq = abstract
            return step(*lead, sampling, generated, eos, inv_freq)

        greedy_args = args[:9] + args[11:]
        measured = self._compile(program, step, args, (1, 2, 3), greedy_step, greedy_args)
        if measured is not None:
            for part in steps:
                kernel = self.kernel_bytes(part, tokens)
                program.add(*measured, kernel, self.unavoidable(self.params, part))
        self.programs.append(program)
        return program

    def prompt_logprobs(self, tokens: int) -> Program:
        """The prompt-logprobs program over one step's hidden states (engine.core.runner):
        the head over every token, a log-softmax, the chosen and the best logprobs."""
        program = Program(f"prompt-logprobs-{tokens}", "prompt-logprobs", 1, tokens)
        whole = self.whole
        args = (
            self.params,
            jax.ShapeDtypeStruct((tokens, self.cfg.hidden_size), self.dtype, sharding=whole),
            jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=whole),
        )
        fn = functools.partial(prompt_logprobs_program, cfg=self.cfg)
        measured = self._compile(program, fn, args, (), fn, args)
        if measured is not None:
            head = self.params.get("lm_head", self.params["embed"])
            must = per_chip_bytes(head) + tokens * self.cfg.hidden_size * self.dtype.itemsize
            program.add(*measured, 0.0, float(must))
        self.programs.append(program)
        return program

    def run(self, which: Sequence[str]) -> list[Program]:
        setup = self.setup
        n, ctx, chunk = setup.max_num_seqs, setup.max_model_len, setup.chunk
        # each busy sequence as long as the pages hold, at most max_model_len
        held = min(ctx, setup.num_pages // n * setup.page_size)
        if "decode" in which:
            self.paged(f"decode-{n}", "decode", Sequences((1,) * n, (held,) * n))
            self.paged("decode-1", "decode", Sequences((1,), (ctx,)))
        if "prefill" in which:
            ends = tuple(range(chunk, PROMPT + 1, chunk))
            self.paged(f"prefill-{PROMPT}", "prefill", Sequences((chunk,), ends), len(ends))
        if "mixed" in which:
            q_lens = (1,) * (n - 1) + (chunk,)
            self.paged(f"mixed-{n}", "mixed", Sequences(q_lens, (held,) * (n - 1) + (PROMPT,)))
        if "prompt-logprobs" in which:
            self.prompt_logprobs(chunk)
        return self.programs


def _bytes_accessed(compiled: Any) -> float:
    return float(compiled.cost_analysis().get("bytes accessed", 0.0))


def default_pages(setup_args: argparse.Namespace) -> int:
    """Pages for max_num_seqs sequences of max_model_len, one spare per sequence."""
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
    parser.add_argument("--num-pages", type=int, default=None, help="default: every sequence full")
    parser.add_argument("--chunk", type=int, default=256, help="prompt tokens per step")
    parser.add_argument(
        "--programs",
        default="decode,prefill,mixed,prompt-logprobs",
        help="of decode,prefill,mixed,prompt-logprobs",
    )
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
        num_pages=args.num_pages or default_pages(args),
        chunk=args.chunk,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # TPU programs cannot load here
    try:
        harness = Harness(setup)
        programs = harness.run(args.programs.split(","))
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    report = {
        "setup": dataclasses.asdict(setup) | {"device_kind": harness.device_kind},
        "programs": [dataclasses.asdict(p) for p in programs],
    }
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    for p in programs:
        ratio = "-" if p.ratio is None else f"{p.ratio:.2f}x"
        print(
            f"{p.name:>20} compiled={p.compiled} {p.bytes_accessed / 1e9:8.2f} GB "
            f"/ {p.unavoidable_bytes / 1e9:7.2f} GB = {ratio:>8}  (XLA's figure "
            f"{p.xla_bytes_accessed / 1e9:.2f} GB)  peak {p.peak_bytes_per_chip / GIB:.2f} GiB  "
            f"{p.compile_s:.1f} s" + (f"  ERROR {p.error}" if p.error else ""),
            file=sys.stderr,
        )
    return report


if __name__ == "__main__":
    main()
