"""Engine-only decode on one accelerator: the paged step at batch 1 and 64, random weights.

Run: `python -m bench.gpu_decode [--configs 1b,8b] [--batches 1,64] [--context 2048]
[--steps 20] [--layers N] [--bandwidth 4.8e12] [--json PATH]`. Made for one H200 with
JAX's CUDA build (JAX 0.11, Python 3.12), within 10 minutes; it runs anywhere (on the
CPU here first, with `--layers 2`, to check it end to end).

For each (config, batch): random bfloat16 params in the checkpoint layout
(engine.paged_model), KV pages for every sequence at `--context` positions, then the
engine core's step (engine.core.runner's forward + sample, greedy, each row fed the
token it sampled last on the device) timed over `--steps` calls after one warm-up call,
each waited for, then again dispatched back to back (one step in flight, as the core's
loop runs them: `*_in_flight`). Prints and writes tokens/s, the step time, the bytes a
step must move (every weight once, each sequence's live K/V, the new K/V) and the
memory-bandwidth utilization: those bytes / step time / `--bandwidth` (the H200's
4.8 TB/s by default). Attention is the backend jax's platform gets
(engine.attention.attention_backend): the XLA reference on GPU and CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.model_shapes import checkpoint_shapes, model_config
from engine.attention import KVLayout, attention_backend
from engine.core.runner import step_program
from engine.paged_model import Chunk, make_batch, stack_layers
from engine.sampling import SamplingArrays, host_arrays
from engine.types import SamplingParams

H200_BYTES_PER_S = 4.8e12
PAGE = 128


def random_params(cfg: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Random params in the checkpoint layout, made on the device (no host copy)."""
    shapes = checkpoint_shapes(cfg, dtype, slot_layout=False)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [
        (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype)
        for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(tree, made)


def run_one(name: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = model_config(name, args.layers, 1)
    dtype = jnp.dtype(args.dtype)
    params = stack_layers(random_params(cfg, dtype))
    per_seq = -(-(args.context + 1) // PAGE)
    layout = KVLayout(batch * per_seq, PAGE, cfg.num_kv_heads, cfg.head_dim, args.dtype)
    platform = jax.devices()[0].platform
    attention = attention_backend(platform, layout.stacked(cfg.num_layers))
    step = jax.jit(
        functools.partial(step_program, cfg=cfg, attention=attention),
        donate_argnums=(1, 2, 3),
    )
    pages = layout.stacked(cfg.num_layers).empty()
    counts = jnp.zeros((batch, cfg.vocab_size), jnp.int32)
    last = jnp.zeros((batch,), jnp.int32)
    carry = jnp.arange(batch, dtype=jnp.int32)  # each row feeds the token it sampled last
    chunks = [
        Chunk([1], args.context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)
    ]
    host = make_batch(
        chunks, tokens=batch, seqs=batch, pages_per_seq=per_seq, page_size=PAGE,
        num_pages=layout.num_pages,
    )  # fmt: skip
    greedy = host_arrays(SamplingParams(temperature=0.0, seed=0), cfg.vocab_size)
    sampling = SamplingArrays(*(jnp.asarray(np.stack([f] * batch)) for f in greedy))
    rows = jnp.arange(batch, dtype=jnp.int32)
    flags = jnp.zeros(batch, bool)
    eos = jnp.zeros(cfg.vocab_size, bool)
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    device_batch = jax.device_put(host)

    def call() -> jax.Array:
        nonlocal pages, counts, last
        out, pages, counts, last, _ = step(
            params, pages, counts, last, device_batch, carry, rows, flags | True, flags,
            sampling, jnp.zeros(batch, jnp.int32), eos, inv_freq,
        )  # fmt: skip
        return out.token

    start = time.perf_counter()
    call().block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    start = time.perf_counter()  # one step in flight, as the core's loop runs them
    for _ in range(args.steps):
        token = call()
    token.block_until_ready()
    in_flight_s = (time.perf_counter() - start) / args.steps
    weights = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:  # an untied embedding: only its gathered rows
        weights -= math.prod(params["embed"].shape) * dtype.itemsize
    kv = batch * (args.context + 1) * layout.token_bytes * cfg.num_layers
    moved = weights + kv
    return {
        "config": name,
        "layers": cfg.num_layers,
        "batch": batch,
        "context": args.context,
        "platform": platform,
        "attention": type(attention).__name__,
        "compile_s": round(compile_s, 2),
        "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(batch / step_s, 1),
        "step_ms_in_flight": round(in_flight_s * 1e3, 3),  # dispatched back to back
        "tokens_per_s_in_flight": round(batch / in_flight_s, 1),
        "bytes_per_step": moved,
        "bandwidth_utilization": round(moved / step_s / args.bandwidth, 4),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="1b,8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bandwidth", type=float, default=H200_BYTES_PER_S)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for name in args.configs.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            result = run_one(name, batch, args)
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
