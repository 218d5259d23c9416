"""Micro-benchmark of one layer's paged attention on XLA:CPU: reference vs CpuAttention.

Owns: the benchmark's shapes (our benchmark models' heads, page size 16, float32) and
its timing. Receives nothing but flags; emits JSON (stdout, or `--json PATH`): per model
and step shape, the median milliseconds of one jitted write + attend for
engine.attention.reference, engine.attention.cpu (decode rows through its kernel,
engine.attention.cpu_kernel) and engine.attention.cpu with XLA's decode groups
(`groups_ms`), and the ratios.

Each step is padded to the runner's buckets (tokens: a power of two, at least 8;
sequences: a power of two), so both backends pay for the padding the engine pays for.
Decode shapes use max_model_len 8192 page tables (the reference gathers the whole
table for every query); the chunk and mixed shapes use 2048, which keeps the
reference's gathered keys within this machine's memory at 512 queries.

    python -m bench.attention_bench [--json PATH] [--models 100m,70m-128k] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine.attention import Attention, AttentionBatch, KVLayout, ReferenceAttention  # noqa: E402
from engine.attention.cpu import CpuAttention  # noqa: E402
from engine.paged_model import Chunk, make_batch  # noqa: E402

PAGE_SIZE = 16
CHUNK_SIZE = 256
MAX_PREFILL_SEQS = 4
# (query heads, kv heads, head_dim) of the benchmark models (bench.models)
MODELS: dict[str, tuple[int, int, int]] = {
    "100m": (12, 4, 64),
    "70m-128k": (4, 2, 64),
    "smollm2-135m": (9, 3, 64),
}


@dataclass(frozen=True)
class Shape:
    """One step: `decode_rows` rows at context `decode_kv`, then one chunk of
    `chunk_queries` queries ending at position `chunk_kv` (0 queries: none)."""

    name: str
    decode_rows: int
    decode_kv: int
    chunk_queries: int
    chunk_kv: int
    max_model_len: int


def shapes(quick: bool) -> list[Shape]:
    rows = (1, 8) if quick else (1, 8, 32, 64)
    contexts = (128, 2048) if quick else (128, 512, 2048, 8192)
    out = [Shape(f"decode-{r}@{c}", r, c, 0, 0, 8192) for r in rows for c in contexts]
    out += [
        Shape("mixed-31+256@1024", 31, 1024, 256, 1024, 2048),
        Shape("chunk-256@256", 0, 0, 256, 256, 2048),
        Shape("chunk-256@2048", 0, 0, 256, 2048, 2048),
    ]
    return out


def power_of_two(n: int, smallest: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return size


@dataclass(frozen=True)
class Step:
    layout: KVLayout
    pages: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    slots: np.ndarray
    batch: AttentionBatch


def build(shape: Shape, model: str, seed: int = 0) -> Step:
    """The step's random pages, queries and new K/V, each sequence at scattered pages."""
    heads, kv_heads, head_dim = MODELS[model]
    rng = np.random.default_rng(seed)
    spans = [(shape.decode_kv - 1, 1)] * shape.decode_rows
    if shape.chunk_queries:
        spans.append((shape.chunk_kv - shape.chunk_queries, shape.chunk_queries))
    needed = [-(-(start + n) // PAGE_SIZE) for start, n in spans]
    num_pages = sum(needed) + 1
    order = rng.permutation(num_pages).astype(np.int32)
    chunks, at = [], 0
    for (start, n), count in zip(spans, needed, strict=True):
        chunks.append(Chunk([0] * n, start, order[at : at + count].tolist()))
        at += count
    tokens = power_of_two(sum(n for _, n in spans), 8)
    step = make_batch(
        chunks,
        tokens=tokens,
        seqs=power_of_two(len(spans), 1),
        pages_per_seq=-(-shape.max_model_len // PAGE_SIZE),
        page_size=PAGE_SIZE,
        num_pages=num_pages,
    )
    layout = KVLayout(num_pages, PAGE_SIZE, kv_heads, head_dim)
    return Step(
        layout=layout,
        pages=rng.standard_normal(layout.shape, np.float32),
        q=rng.standard_normal((tokens, heads, head_dim), np.float32),
        k=rng.standard_normal((tokens, kv_heads, head_dim), np.float32),
        v=rng.standard_normal((tokens, kv_heads, head_dim), np.float32),
        slots=np.asarray(step.slots),
        batch=step.attention,
    )


def layer_step(attention: Attention) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """One layer's write + attend, jitted, the pages donated as the runner donates them."""

    def run(
        pages: jax.Array,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        slots: jax.Array,
        batch: AttentionBatch,
    ) -> tuple[jax.Array, jax.Array]:
        pages = attention.write(pages, k, v, slots)
        return attention.attend(q, pages, batch), pages

    return jax.jit(run, donate_argnums=(0,))


def time_step(
    attention: Attention, step: Step, repeats: int, budget_s: float
) -> tuple[float, np.ndarray]:
    """Median seconds of a call after a warm-up call (at least 3 runs, up to `repeats`
    or until `budget_s` is spent), and the call's output."""
    fn = layer_step(attention)
    pages = jnp.asarray(step.pages)
    args = (step.q, step.k, step.v, step.slots, step.batch)
    out, pages = fn(pages, *args)
    out.block_until_ready()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - began < budget_s):
        start = time.perf_counter()
        out, pages = fn(pages, *args)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times), np.asarray(out)


def measure(shape: Shape, model: str, repeats: int, budget_s: float) -> dict[str, object]:
    step = build(shape, model)
    backends: Sequence[tuple[str, Attention]] = (
        ("reference", ReferenceAttention(step.layout)),
        (
            "cpu",
            CpuAttention(step.layout, chunk_size=CHUNK_SIZE, max_prefill_seqs=MAX_PREFILL_SEQS),
        ),
        (
            "groups",
            CpuAttention(
                step.layout,
                chunk_size=CHUNK_SIZE,
                max_prefill_seqs=MAX_PREFILL_SEQS,
                kernel=False,
            ),
        ),
    )
    seconds, outputs = {}, {}
    for name, attention in backends:
        seconds[name], outputs[name] = time_step(attention, step, repeats, budget_s)
    return {
        "model": model,
        **asdict(shape),
        "tokens": int(step.q.shape[0]),
        "seqs": int(step.batch.kv_lens.shape[0]),
        "reference_ms": round(seconds["reference"] * 1e3, 3),
        "cpu_ms": round(seconds["cpu"] * 1e3, 3),
        "groups_ms": round(seconds["groups"] * 1e3, 3),
        "speedup": round(seconds["reference"] / seconds["cpu"], 2),
        "groups_over_cpu": round(seconds["groups"] / seconds["cpu"], 2),
        "max_abs_diff": float(np.max(np.abs(outputs["reference"] - outputs["cpu"]))),
        "groups_max_abs_diff": float(np.max(np.abs(outputs["reference"] - outputs["groups"]))),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here (default: stdout)")
    parser.add_argument("--models", default="100m,70m-128k")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (all)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per backend")
    parser.add_argument("--quick", action="store_true", help="fewer decode shapes")
    args = parser.parse_args(argv)
    wanted = {s for s in args.shapes.split(",") if s}
    results = []
    for model in args.models.split(","):
        for shape in shapes(args.quick):
            if wanted and shape.name not in wanted:
                continue
            row = measure(shape, model, args.repeats, args.budget)
            print(json.dumps(row), file=sys.stderr, flush=True)
            results.append(row)
    report = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "page_size": PAGE_SIZE,
        "chunk_size": CHUNK_SIZE,
        "max_prefill_seqs": MAX_PREFILL_SEQS,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
