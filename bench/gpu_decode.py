"""Engine-only decode and prefill on one accelerator: the paged step, random weights.

Run: `python -m bench.gpu_decode [--configs 1b,8b] [--batches 1,8,64,256] [--context 2048]
[--prefill 1024,8192] [--prefill-chunk 2048] [--attention gpu-pallas] [--page-size 16]
[--steps 20] [--layers N] [--bandwidth 4.8e12] [--peak-flops 989e12] [--json PATH]`.
Made for one H200 with JAX's CUDA build (JAX 0.11, Python 3.12); bench.gpu_check runs it
with the rest of the GPU check. It runs anywhere: off a GPU the Pallas kernel runs in
Pallas' interpreter (slow; `--configs tiny` keeps it to seconds, tests/bench).

Decode, for each (config, batch): random bfloat16 params in the checkpoint layout
(engine.paged_model), KV pages for every sequence at `--context` positions, then the
engine core's step (engine.core.runner's forward + sample, greedy, each row fed the token
it sampled last on the device) timed over `--steps` calls after one warm-up call, each
waited for, then again dispatched back to back (one step in flight, as the core's loop
runs them: `*_in_flight`). Reports tokens/s, the step time, the bytes a step must move
(every weight once, each sequence's live K/V, the new K/V) and the memory-bandwidth
utilization: those bytes / step time / `--bandwidth` (the H200's 4.8 TB/s by default).

Prefill, for each (config, prompt length): one sequence's prompt through the same step
program in chunks of `--prefill-chunk` positions (each chunk attends to those before it),
timed whole after a warm-up pass; tokens/s and FLOP utilization: the products' FLOPs
(2 per weight per token, and causal attention's 2 x layers x heads x head_dim x
prompt^2) / time / `--peak-flops` (the H200's 989 TFLOP/s dense bfloat16).

`--no-command-buffers` compiles the step with no command buffers (engine.xla_flags sets
them for GPU), to measure what CUDA graphs save. `--attention`: reference (the pure-JAX
definition over interleaved pages), gpu-xla or gpu-pallas (engine.attention.gpu over
head-major pages). `--xla-reduce` computes norms with XLA's own reduce and RoPE as a
product (the TPU's numerics, engine.core.core `backend_numerics`) instead of the
fixed-order sums CPU keeps bit-exact.
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
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.model_shapes import CONFIGS, checkpoint_shapes, model_config
from engine.attention import Attention, KVLayout, ReferenceAttention, attention_layout
from engine.attention.gpu import GpuAttention
from engine.config import ModelConfig
from engine.core.runner import step_program
from engine.paged_model import Chunk, make_batch, stack_layers
from engine.sampling import SamplingArrays, host_arrays
from engine.types import SamplingParams
from engine.xla_flags import set_backend_flags

H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12  # dense
ATTENTION = ("reference", "gpu-xla", "gpu-pallas")
# A few-layer shape for runs on the CPU (tests/bench): every code path, in seconds.
TINY = dataclasses.replace(
    CONFIGS["1b"], vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2,
    head_dim=32, intermediate_size=256, num_layers=2,
)  # fmt: skip


def shape(name: str, layers: int | None) -> ModelConfig:
    if name == "tiny":
        return TINY if layers is None else dataclasses.replace(TINY, num_layers=layers)
    return model_config(name, layers, 1)


def random_params(cfg: ModelConfig, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Random params in the checkpoint layout, made on the device (no host copy)."""
    shapes = checkpoint_shapes(cfg, dtype, slot_layout=False)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [
        (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype)
        for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(tree, made)


def make_attention(layout: KVLayout, name: str) -> tuple[Attention, KVLayout]:
    """The backend `name` and the page layout it reads; off a GPU the Pallas kernel runs
    in Pallas' interpreter."""
    if name == "reference":
        return ReferenceAttention(layout), layout
    on_gpu = jax.devices()[0].platform == "gpu"
    head_major = attention_layout(layout, "gpu")
    kernel = name.removeprefix("gpu-")
    return GpuAttention(head_major, kernel=kernel, interpret=not on_gpu), head_major


@dataclasses.dataclass
class Engine:
    """One config's params and step program over `layout`'s pages."""

    cfg: ModelConfig
    params: dict[str, Any]
    attention: str
    page_size: int
    command_buffers: bool = True  # False: none for this program (XLA_FLAGS' are process-wide)

    def program(self, layout: KVLayout) -> tuple[Callable[..., Any], KVLayout]:
        """The step over every layer's pages (KVLayout.stacked), and one layer's layout."""
        attention, read = make_attention(layout.stacked(self.cfg.num_layers), self.attention)
        options = {} if self.command_buffers else {"xla_gpu_enable_command_buffer": ""}
        step = jax.jit(
            functools.partial(step_program, cfg=self.cfg, attention=attention),
            donate_argnums=(1, 2, 3),
            compiler_options=options,
        )
        return step, dataclasses.replace(read, num_pages=layout.num_pages)

    def weight_bytes(self) -> int:
        total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(self.params))
        if not self.cfg.tie_word_embeddings:  # an untied embedding: only its gathered rows
            embed = self.params["embed"]
            total -= math.prod(embed.shape) * embed.dtype.itemsize
        return total

    def layer_weights(self) -> int:
        """Weights one token multiplies in the layers' products (2 FLOPs each; not norms)."""
        layers = jax.tree.leaves(self.params["layers"])  # stacked: (layers, out, in)
        return sum(math.prod(w.shape) for w in layers if w.ndim == 3)


def run_steps(
    engine: Engine, layout: KVLayout, chunks: list[list[Chunk]], tokens: int, seqs: int
) -> Callable[[], jax.Array]:
    """A function running the step program once per batch of `chunks`, in order, feeding
    each row the token it sampled the step before; returns the last step's tokens."""
    step, layout = engine.program(layout)
    cfg = engine.cfg
    per_seq = max(len(c.pages) for batch in chunks for c in batch)
    batches = [
        jax.device_put(
            make_batch(
                batch, tokens=tokens, seqs=seqs, pages_per_seq=per_seq,
                page_size=layout.page_size, num_pages=layout.num_pages,
            )
        )
        for batch in chunks
    ]  # fmt: skip
    state: dict[str, Any] = {
        "pages": layout.stacked(cfg.num_layers).empty(),
        "counts": jnp.zeros((seqs, cfg.vocab_size), jnp.int32),
        "last": jnp.zeros((seqs,), jnp.int32),
    }
    decode = tokens == seqs
    carry = jnp.arange(tokens, dtype=jnp.int32) if decode else jnp.full(tokens, -1, jnp.int32)
    greedy = host_arrays(SamplingParams(temperature=0.0, seed=0), cfg.vocab_size)
    sampling = SamplingArrays(*(jnp.asarray(np.stack([f] * seqs)) for f in greedy))
    rows = jnp.arange(seqs, dtype=jnp.int32)
    flags = jnp.zeros(seqs, bool)
    eos = jnp.zeros(cfg.vocab_size, bool)
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    generated = jnp.zeros(seqs, jnp.int32)

    def call() -> jax.Array:
        token = None
        for batch in batches:
            out, state["pages"], state["counts"], state["last"], _ = step(
                engine.params, state["pages"], state["counts"], state["last"], batch, carry,
                rows, flags | True, flags, sampling, generated, eos, inv_freq,
            )  # fmt: skip
            token = out.token
        assert token is not None
        return token

    return call


def timed(call: Callable[[], jax.Array], repeats: int) -> tuple[float, float, float]:
    """Compile + first run, the median of waited runs, and the mean dispatched back to
    back (seconds)."""
    start = time.perf_counter()
    call().block_until_ready()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        token = call()
    token.block_until_ready()
    return first, float(np.median(times)), (time.perf_counter() - start) / repeats


def decode(engine: Engine, name: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = engine.cfg
    per_seq = -(-(args.context + 1) // engine.page_size)
    layout = KVLayout(batch * per_seq, engine.page_size, cfg.num_kv_heads, cfg.head_dim, args.dtype)
    chunks = [
        Chunk([1], args.context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)
    ]
    first, step_s, in_flight_s = timed(
        run_steps(engine, layout, [chunks], batch, batch), args.steps
    )
    moved = engine.weight_bytes() + batch * (args.context + 1) * layout.token_bytes * cfg.num_layers
    return {
        "kind": "decode",
        "config": name,
        "layers": cfg.num_layers,
        "batch": batch,
        "context": args.context,
        "page_size": engine.page_size,
        "platform": jax.devices()[0].platform,
        "attention": engine.attention,
        "xla_reduce": args.xla_reduce,
        "command_buffers": engine.command_buffers,
        "compile_s": round(first, 2),
        "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(batch / step_s, 1),
        "step_ms_in_flight": round(in_flight_s * 1e3, 3),  # dispatched back to back
        "tokens_per_s_in_flight": round(batch / in_flight_s, 1),
        "bytes_per_step": moved,
        "bandwidth_utilization": round(moved / step_s / args.bandwidth, 4),
    }


def prefill(engine: Engine, name: str, prompt: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = engine.cfg
    chunk = min(args.prefill_chunk, prompt)
    pages = list(range(-(-prompt // engine.page_size)))
    layout = KVLayout(len(pages), engine.page_size, cfg.num_kv_heads, cfg.head_dim, args.dtype)
    steps = [[Chunk([1] * chunk, start, pages)] for start in range(0, prompt - chunk + 1, chunk)]
    first, total_s, _ = timed(run_steps(engine, layout, steps, chunk, 1), args.prefill_repeats)
    done = chunk * len(steps)
    flops = 2 * engine.layer_weights() * done
    flops += 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * done * done  # causal QK, PV
    return {
        "kind": "prefill",
        "config": name,
        "layers": cfg.num_layers,
        "prompt": done,
        "chunk": chunk,
        "page_size": engine.page_size,
        "platform": jax.devices()[0].platform,
        "attention": engine.attention,
        "xla_reduce": args.xla_reduce,
        "compile_s": round(first, 2),
        "prefill_ms": round(total_s * 1e3, 3),
        "tokens_per_s": round(done / total_s, 1),
        "flops": flops,
        "flop_utilization": round(flops / total_s / args.peak_flops, 4),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--configs", default="1b,8b")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill", default="1024,8192", help="prompt lengths ('' for none)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--attention", choices=ATTENTION, default="gpu-pallas")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--xla-reduce", action="store_true")
    p.add_argument("--no-command-buffers", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--bandwidth", type=float, default=H200_BYTES_PER_S)
    p.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    p.add_argument("--json", type=Path, default=None)
    return p


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    set_backend_flags(os.environ)  # as the engine core's process: before a backend starts
    results = []
    for name in args.configs.split(","):
        cfg = shape(name, args.layers)
        if args.xla_reduce:
            cfg = dataclasses.replace(cfg, fixed_order_sums=False, rope_by_product=True)
        params = stack_layers(random_params(cfg, jnp.dtype(args.dtype)))
        engine = Engine(cfg, params, args.attention, args.page_size, not args.no_command_buffers)
        runs = [functools.partial(decode, engine, name, b, args) for b in ints(args.batches)]
        runs += [functools.partial(prefill, engine, name, n, args) for n in ints(args.prefill)]
        for run in runs:
            result = run()
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
        del engine, params  # the next config's weights get the memory
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
