"""Slot-engine benchmark: decode step and prefill times against this machine's roofline.

Run: `python -m bench.engine_bench [--models tiny,100m] [--slots 1,4,16] [--steps 8]`.
Prints one JSON object. Each figure is set against a roofline measured in the
same run: peak float32 matmul FLOP/s (best of jax and numpy) and memory copy
bandwidth (read + write bytes / s), measured before and after the models and
the best kept (for a bfloat16 run the matmul peak includes a bfloat16 product
accumulating in float32, which this CPU runs ~1.7x faster than float32). A
step's floor is the larger of its true work over each peak;
`roofline_fraction` = floor / median step time (`roofline_fraction_best`: over
the fastest step; the machine is shared, so the median carries others' load).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.tiny import build_llama_checkpoint, write_tiny_checkpoint  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, seed=0)


@dataclass(frozen=True)
class Roofline:
    flops_per_s: float
    bytes_per_s: float

    def floor_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


def best_time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_roofline(
    dtype: str = "float32", n: int = 3072, copy_mb: int = 256
) -> tuple[Roofline, dict[str, float]]:
    """Peak matmul FLOP/s (best of jax and numpy; in bfloat16 too for a bfloat16 run) and
    copy bandwidth (best of both)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(ja, jb).block_until_ready()
    flops = 2.0 * n**3
    jax_gflops = flops / best_time(lambda: matmul(ja, jb).block_until_ready(), 7) / 1e9
    numpy_gflops = flops / best_time(lambda: a @ b, 7) / 1e9
    src = np.ones(copy_mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    numpy_copy = 2 * src.nbytes / best_time(lambda: np.copyto(dst, src), 5) / 1e9
    jsrc = jnp.asarray(src)
    copy = jax.jit(lambda x: x + 1.0)
    copy(jsrc).block_until_ready()
    jax_copy = 2 * src.nbytes / best_time(lambda: copy(jsrc).block_until_ready(), 5) / 1e9
    figures = {
        "matmul_gflops_jax": jax_gflops,
        "matmul_gflops_numpy": numpy_gflops,
        "copy_gbps_numpy": numpy_copy,
        "copy_gbps_jax": jax_copy,
    }
    if dtype == "bfloat16":
        ha, hb = ja.astype(jnp.bfloat16), jb.astype(jnp.bfloat16)
        dims = (((1,), (0,)), ((), ()))
        half = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32))
        half(ha, hb).block_until_ready()
        figures["matmul_gflops_jax_bfloat16"] = (
            flops / best_time(lambda: half(ha, hb).block_until_ready(), 7) / 1e9
        )
    peak_gflops = max(v for k, v in figures.items() if k.startswith("matmul"))
    roof = Roofline(peak_gflops * 1e9, max(numpy_copy, jax_copy) * 1e9)
    return roof, figures


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (all but the embedding lookup)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def decode_work(cfg: ModelConfig, contexts: list[int], itemsize: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step over slots with these real context lengths."""
    params = matmul_params(cfg)
    attn_flops = sum(4 * cfg.num_layers * cfg.q_size * c for c in contexts)
    flops = 2.0 * params * len(contexts) + attn_flops
    kv_bytes = sum(2 * cfg.num_layers * cfg.kv_size * c * itemsize for c in contexts)
    return flops, float(params * itemsize + kv_bytes)


def prefill_work(cfg: ModelConfig, tokens: int, itemsize: int) -> tuple[float, float]:
    params = matmul_params(cfg) - cfg.vocab_size * cfg.hidden_size  # logits at one position
    attn = 2 * cfg.num_layers * cfg.q_size * tokens * tokens  # causal half of 4*T^2
    flops = 2.0 * params * tokens + 2.0 * cfg.vocab_size * cfg.hidden_size + attn
    return flops, float(matmul_params(cfg) * itemsize)


def bench_decode(engine: Engine, fill: int, steps: int, itemsize: int) -> dict[str, Any]:
    """Every slot holds a `fill`-token context; time `steps` generate calls one by one."""
    prefix = engine.prefill([(7 * i) % engine.vocab_size for i in range(fill)], GREEDY)
    state = engine.init_state()
    for slot in range(engine.max_slots):
        state = engine.insert(prefix, state, slot)
    state, out = engine.generate(state)  # compiled by warm-up; this one warms caches
    jax.block_until_ready(out.tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = engine.generate(state)
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    contexts = [fill + 1 + steps // 2] * engine.max_slots
    flops, nbytes = decode_work(engine.model_config, contexts, itemsize)
    return {
        "slots": engine.max_slots,
        "context": contexts[0],
        "step_ms": step_s * 1e3,
        "best_step_ms": min(times) * 1e3,
        "tokens_per_s": engine.max_slots / step_s,
        "work_gflop": flops / 1e9,
        "work_mbytes": nbytes / 1e6,
        "gflops": flops / step_s / 1e9,
    }


def bench_prefill(engine: Engine, itemsize: int) -> list[dict[str, Any]]:
    rows = []
    for bucket in engine.prefill_buckets:
        length = min(bucket, engine.max_prompt_len)
        prompt = [(3 * i) % engine.vocab_size for i in range(length)]
        run = lambda p=prompt: jax.block_until_ready(engine.prefill(p, GREEDY).token)
        run()
        seconds = best_time(run, 3)
        flops, nbytes = prefill_work(engine.model_config, bucket, itemsize)
        rows.append(
            {
                "bucket": bucket,
                "ms": seconds * 1e3,
                "tokens_per_s": length / seconds,
                "work_gflop": flops / 1e9,
                "work_mbytes": nbytes / 1e6,
            }
        )
    return rows


def add_roofline(run: dict[str, Any], roof: Roofline) -> dict[str, Any]:
    """Floors and roofline fractions of every row against `roof`."""
    for row in run["decode"]:
        flops, nbytes = row["work_gflop"] * 1e9, row["work_mbytes"] * 1e6
        floor = roof.floor_s(flops, nbytes)
        compute_bound = flops / roof.flops_per_s >= nbytes / roof.bytes_per_s
        row["floor_ms"] = floor * 1e3
        row["bound"] = "compute" if compute_bound else "memory"
        row["roofline_fraction"] = floor * 1e3 / row["step_ms"]
        row["roofline_fraction_best"] = floor * 1e3 / row["best_step_ms"]
    for row in run["prefill"]:
        floor = roof.floor_s(row["work_gflop"] * 1e9, row["work_mbytes"] * 1e6)
        row["roofline_fraction"] = floor * 1e3 / row["ms"]
    return run


def bench_model(
    name: str,
    folder: Path,
    slots: list[int],
    max_len: int,
    max_prefill: int,
    steps: int,
    dtype: str,
) -> dict[str, Any]:
    itemsize = 4 if dtype == "float32" else 2
    result: dict[str, Any] = {"model": name, "dtype": dtype, "max_model_len": max_len}
    decode = []
    for count in slots:
        config = EngineConfig(
            folder, dtype=dtype, max_slots=count, max_model_len=max_len,
            max_prefill_len=max_prefill,
        )  # fmt: skip
        engine = Engine(config)
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        if count == slots[0]:
            cfg = engine.model_config
            result["matmul_params"] = matmul_params(cfg)
            result["warmup_s"] = warmup_s
            result["prefill"] = bench_prefill(engine, itemsize)
        decode.append(bench_decode(engine, max_len // 2, steps, itemsize))
    result["decode"] = decode
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--slots", default="1,4,16")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    slots = [int(s) for s in args.slots.split(",")]
    before, machine_before = measure_roofline(args.dtype)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                folder = write_tiny_checkpoint(Path(tmp) / "tiny", arch="llama")
                max_len, max_prefill = 512, 256
            elif name == "100m":
                folder = build_llama_checkpoint(
                    Path(tmp) / "100m", 768, 12, 12, 4, 2048, 32000,
                    max_position_embeddings=1024,
                )  # fmt: skip
                max_len, max_prefill = 1024, 512
            else:
                raise SystemExit(f"unknown model {name!r} (tiny, 100m)")
            runs.append(
                bench_model(name, folder, slots, max_len, max_prefill, args.steps, args.dtype)
            )
    after, machine_after = measure_roofline(args.dtype)
    roof = Roofline(
        max(before.flops_per_s, after.flops_per_s), max(before.bytes_per_s, after.bytes_per_s)
    )
    report = {
        "devices": str(jax.devices()),
        "machine_before": machine_before,
        "machine_after": machine_after,
        "peak_gflops": roof.flops_per_s / 1e9,
        "peak_copy_gbps": roof.bytes_per_s / 1e9,
        "models": [add_roofline(run, roof) for run in runs],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
