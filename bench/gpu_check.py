"""The GPU check: one script for one lent H200, within 8 minutes.

Run from the repository root: `python -m bench.gpu_check --json OUT.json [--budget-s 420]
[--smoke]`. Needs what bench.gpu_decode needs and nothing else: Python 3.12, jax 0.11
with its CUDA 13 plugin (Pallas' Triton lowering ships in jaxlib), numpy and the
engine's own imports (safetensors); no network, no package index, no checkpoint (random
weights). `--smoke` runs every part at tiny shapes in seconds on any backend (the CPU
suite does, tests/bench/test_gpu_check.py); off a GPU its figures mean nothing.

Parts, in priority order; a part that would start past `--budget-s` is listed as skipped:
1. kernel: engine.attention.gpu's Pallas kernel and XLA form against the reference on
   the device (1B and 8B heads, pages of 16, a batch of decode rows and prompt chunks
   across page edges with padding), float32 and bfloat16; max error and a pass flag
   (bfloat16 within 3e-2; float32 within 1e-4, products at full precision).
2. attention: one decode layer's attention alone, 8B heads, 64 sequences of 2,048
   positions, pages of 16 and 128: the reference over interleaved pages, the XLA form
   and the Pallas kernel over head-major pages; median ms of 30 calls and the K/V bytes
   read per second (bench/README.md, "One H200", the 0.89 / 0.61 / 0.40 ms before).
3. engine: bench.gpu_decode's rows: 8B and 1B decode at batch 1 and 64 (the issue's
   targets), what the KV pool holds for 8B beside its weights (engine.core.memory at the
   GPU's defaults), 8B prefill of 8,192 positions, then batch 8 and 256, 1B prefill, and
   for batch 1 without command buffers and with XLA's own reduce (what each saves).
Each row is printed as a JSON line when done and all are written to `--json`.
"""

from __future__ import annotations

import os

from engine.xla_flags import set_backend_flags

# before jax starts a backend: XLA reads XLA_FLAGS once; the allocator takes 0.9 of the
# device (engine.core.defaults), room for 8B x 256's ~87 GB beside both configs' weights
set_backend_flags(os.environ)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import gpu_decode  # noqa: E402
from engine.attention import AttentionBatch, KVLayout, attention_layout  # noqa: E402
from engine.core.defaults import defaults_for  # noqa: E402
from engine.core.memory import KVBudget, pages_for_budget  # noqa: E402
from engine.mesh import default_mesh  # noqa: E402
from engine.paged_model import Chunk, make_batch, stack_layers  # noqa: E402

Row = dict[str, Any]
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@dataclass(frozen=True)
class Heads:
    kv_heads: int
    groups: int
    head_dim: int


HEADS = {"1b": Heads(8, 4, 64), "8b": Heads(8, 4, 128), "tiny": Heads(2, 2, 32)}


def attention_case(
    heads: Heads,
    page: int,
    spans: Sequence[tuple[int, int]],
    tokens: int,
    seqs: int,
    seed: int,
    dtype: str,
) -> tuple[np.ndarray, np.ndarray, AttentionBatch, KVLayout]:
    """Random queries and interleaved pages of `dtype` (their values in float32) for these
    (start, queries) sequences in a (tokens, seqs) bucket, each on its own scattered pages."""
    rng = np.random.default_rng(seed)
    counts = [-(-(start + n) // page) for start, n in spans]
    layout = KVLayout(sum(counts) + 1, page, heads.kv_heads, heads.head_dim, dtype)
    order = rng.permutation(np.arange(1, layout.num_pages)).tolist()
    chunks, at = [], 0
    for (start, n), count in zip(spans, counts, strict=True):
        chunks.append(Chunk([0] * n, start, order[at : at + count]))
        at += count
    step = make_batch(
        chunks, tokens=tokens, seqs=seqs, pages_per_seq=max(counts), page_size=page,
        num_pages=layout.num_pages,
    )  # fmt: skip
    q = rng.standard_normal((tokens, heads.kv_heads * heads.groups, heads.head_dim))
    pages = rng.standard_normal(layout.shape).astype(np.float32)
    return q.astype(np.float32), pages, step.attention, layout


def kernel_check(name: str, dtype: str, smoke: bool) -> list[Row]:
    heads = HEADS[name]
    long = 40 if smoke else 1000
    spans = [(long, 1), (15, 1), (16, 1), (0, 37), (17, 1), (long - 30, 30)]
    q, pages, batch, layout = attention_case(heads, 16, spans, 96, 8, seed=1, dtype=dtype)
    real = sum(n for _, n in spans)
    qj, flat = jnp.asarray(q, dtype), jnp.asarray(pages, dtype)
    rows = []
    with jax.default_matmul_precision("highest"):
        reference, _ = gpu_decode.make_attention(layout, "reference")
        want = np.asarray(jax.jit(reference.attend)(qj, flat, batch).astype(jnp.float32))
        for form in ("gpu-pallas", "gpu-xla"):
            attention, _ = gpu_decode.make_attention(layout, form)
            got = jax.jit(attention.attend)(qj, flat.transpose(2, 0, 1, 3), batch)
            got = np.asarray(got.astype(jnp.float32))
            error = float(np.abs(got[:real] - want[:real]).max())
            rows.append({
                "kind": "kernel_check", "heads": name, "dtype": dtype, "attention": form,
                "max_abs_error": error, "tolerance": TOL[dtype],
                "ok": bool(error <= TOL[dtype] and not got[real:].any()),
            })  # fmt: skip
    return rows


def attention_timing(name: str, page: int, seqs: int, context: int, calls: int) -> list[Row]:
    heads = HEADS[name]
    spans = [(context - 1, 1)] * seqs
    q, pages, batch, layout = attention_case(heads, page, spans, seqs, seqs, 2, "bfloat16")
    qj = jnp.asarray(q, jnp.bfloat16)
    kv_bytes = seqs * context * layout.token_bytes
    rows = []
    for form in gpu_decode.ATTENTION:
        attention, read = gpu_decode.make_attention(layout, form)
        host = pages if not read.head_major else pages.transpose(2, 0, 1, 3)
        device_pages = jnp.asarray(host, jnp.bfloat16)
        fn = jax.jit(attention.attend)
        fn(qj, device_pages, batch).block_until_ready()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn(qj, device_pages, batch).block_until_ready()
            times.append(time.perf_counter() - start)
        ms = float(np.median(times)) * 1e3
        rows.append({
            "kind": "attention", "heads": name, "page_size": page, "seqs": seqs,
            "context": context, "attention": form, "ms": round(ms, 4),
            "kv_bytes_per_s": round(kv_bytes / (ms / 1e3)),
        })  # fmt: skip
    return rows


def pool(name: str, page: int) -> Row:
    """The pages the engine core would size for `name` with its weights resident now
    (engine.core.memory at the platform's defaults), and what they hold."""
    cfg = gpu_decode.shape(name, None)
    device = jax.devices()[0]
    defaults = defaults_for(device.platform)
    probe = KVLayout(1, page, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    layout = attention_layout(probe, device.platform)
    budget = KVBudget(memory_utilization=defaults.memory_utilization)
    pages = pages_for_budget(budget, layout, cfg.num_layers, default_mesh(1))
    stats = device.memory_stats() or {}
    positions = pages * page
    return {
        "kind": "pool", "config": name, "page_size": page,
        "allocator_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "memory_utilization": defaults.memory_utilization,
        "bytes_limit": stats.get("bytes_limit"), "bytes_in_use": stats.get("bytes_in_use"),
        "pages": pages, "kv_bytes": pages * layout.page_bytes * cfg.num_layers,
        "positions": positions, "sequences_of_2048": positions // 2048,
        "sequences_of_131072": positions // 131072,
    }  # fmt: skip


def engine_runs(smoke: bool) -> list[tuple[str, Callable[[], list[Row]]]]:
    """bench.gpu_decode's rows, most wanted first; params made once per config."""
    base = ["--context", "48", "--steps", "2", "--prefill-chunk", "32"] if smoke else []
    base += ["--prefill-repeats", "1"] if smoke else []
    params: dict[str, dict[str, Any]] = {}  # by config: every variant shares its weights

    def engine(name: str, args: argparse.Namespace) -> gpu_decode.Engine:
        cfg = gpu_decode.shape(name, args.layers)
        if name not in params:
            params[name] = stack_layers(gpu_decode.random_params(cfg, jnp.dtype(args.dtype)))
        if args.xla_reduce:
            cfg = replace(cfg, fixed_order_sums=False, rope_by_product=True)
        command_buffers = not args.no_command_buffers
        return gpu_decode.Engine(cfg, params[name], args.attention, args.page_size, command_buffers)

    def one(kind: str, name: str, size: int, *extra: str) -> Callable[[], list[Row]]:
        args = gpu_decode.parser().parse_args([*base, *extra])
        if smoke:  # the interpreter's kernel takes minutes to compile a model's layers
            args.attention = "gpu-xla"
        run = gpu_decode.decode if kind == "decode" else gpu_decode.prefill
        return lambda: [run(engine(name, args), name, size, args)]

    def pool_of(name: str) -> Callable[[], list[Row]]:
        def run() -> list[Row]:
            args = gpu_decode.parser().parse_args(base)
            engine(name, args)  # its weights resident, as a served model's
            return [pool(name, args.page_size)]

        return run

    big = ("tiny", "tiny") if smoke else ("8b", "1b")
    long_prompt = 64 if smoke else 8192
    runs = [
        (f"{big[0]} pool", pool_of(big[0])),
        (f"{big[0]} decode 1", one("decode", big[0], 1)),
        (f"{big[0]} decode 64", one("decode", big[0], 4 if smoke else 64)),
        (f"{big[1]} decode 1", one("decode", big[1], 1)),
        (f"{big[1]} decode 64", one("decode", big[1], 4 if smoke else 64)),
        (f"{big[0]} prefill {long_prompt}", one("prefill", big[0], long_prompt)),
    ]
    if smoke:
        return runs
    for name in big:
        runs += [(f"{name} decode {b}", one("decode", name, b)) for b in (8, 256)]
    runs += [(f"{name} prefill 1024", one("prefill", name, 1024)) for name in ("8b", "1b")]
    runs += [("1b prefill 8192", one("prefill", "1b", 8192))]
    for name in ("1b", "8b"):
        runs += [(f"{name} decode 1 no graphs", one("decode", name, 1, "--no-command-buffers"))]
        runs += [(f"{name} decode 1 xla reduce", one("decode", name, 1, "--xla-reduce"))]
    runs += [("8b decode 64 reference", one("decode", "8b", 64, "--attention", "reference"))]
    return runs


def parts(smoke: bool) -> list[tuple[str, Callable[[], list[Row]]]]:
    names = ("tiny",) if smoke else ("8b", "1b")
    found: list[tuple[str, Callable[[], list[Row]]]] = []
    for name in names:
        for dtype in ("bfloat16", "float32"):
            check = functools.partial(kernel_check, name, dtype, smoke)
            found.append((f"kernel {name} {dtype}", check))
    seqs, context, calls = (2, 64, 2) if smoke else (64, 2048, 30)
    for page in (16, 128):
        timing = functools.partial(attention_timing, names[0], page, seqs, context, calls)
        found.append((f"attention page {page}", timing))
    return found + engine_runs(smoke)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    start = time.perf_counter()
    device = jax.devices()[0]
    header = {
        "kind": "setup", "platform": device.platform, "device": device.device_kind,
        "jax": jax.__version__, "python": sys.version.split()[0],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }  # fmt: skip
    print(json.dumps(header), flush=True)
    rows: list[Row] = [header]
    for title, part in parts(args.smoke):
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            rows.append({"kind": "skipped", "part": title, "elapsed_s": round(elapsed, 1)})
        else:
            try:
                done = part()
            except Exception as exc:  # a part's failure is a row; the parts after it still run
                done = [{"kind": "failed", "part": title, "error": f"{type(exc).__name__}: {exc}"}]
            for row in done:
                row["elapsed_s"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
            rows += done
        if rows[-1]["kind"] == "skipped":
            print(json.dumps(rows[-1]), flush=True)
        if args.json is not None:  # after every part: a run cut short keeps what it had
            args.json.write_text(json.dumps(rows, indent=1))
    if device.platform != "gpu":
        print("not a GPU: these figures check the script only", flush=True)
    return rows


if __name__ == "__main__":
    main()
