"""Slot-engine benchmark: decode step and prefill times against this machine's roofline.

Run: `python -m bench.engine_bench [--models tiny,100m,128k] [--slots 1,8,32] [--steps 16]`.
Prints one JSON object. Each figure is set against a roofline measured in the
same run: peak float32 matmul FLOP/s (best of jax and numpy) and memory copy
bandwidth (read + write bytes / s), measured before and after the models and
the best kept (for a bfloat16 run the matmul peak includes a bfloat16 product
accumulating in float32, which this CPU runs ~1.7x faster than float32). A
step's floor is the larger of its true work over each peak;
`roofline_fraction` = floor / median step time (`roofline_fraction_best`: over
the fastest step; the machine is shared, so the median carries others' load).

Two ratios are measured against a reference timed in the same loop, the two
alternating call by call so that others' load falls on both alike:
`step_over_lm_head`: each decode row's step against its own lm_head product
alone (the model's unavoidable work on a large vocabulary, in the engine's layout:
(vocab, hidden) x (slots, hidden)^T on CPU, engine.model.step_logits;
`step_over_hidden_major_lm_head`: against (slots, hidden) x (hidden, vocab));
`light_load`: one busy slot on the largest engine against a 1-slot engine,
both holding the same context (what decode batch buckets buy). Each ratio is
the median over rounds of the two calls' ratio; `_best` ratios set the
fastest call of each against the other.
The `128k` model is the issue's shape: hidden 256, 4 layers, Llama 3's 128,256
-token vocabulary, ~68.6M parameters, ~90% of the step's FLOPs in the lm_head.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from engine.model import step_logits  # noqa: E402
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


class Stepper:
    """Slots 0..busy-1 of an engine holding a `fill`-token context, stepped one call at a
    time in the decode bucket that covers them, as the generate stage steps them."""

    def __init__(self, engine: Engine, fill: int, busy: int | None = None):
        self.engine = engine
        busy = engine.max_slots if busy is None else busy
        prefix = engine.prefill([(7 * i) % engine.vocab_size for i in range(fill)], GREEDY)
        self.state = engine.init_state()
        for slot in range(busy):
            self.state = engine.insert(prefix, self.state, slot)
        self.batch = engine.decode_bucket(busy)
        self()  # compiled by warm-up; this one warms caches

    def __call__(self) -> None:
        self.state, out = self.engine.generate(self.state, self.batch)
        jax.block_until_ready(out.tokens)


def interleaved(fns: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, the fns called in turn `rounds` times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def lm_head_product(engine: Engine, rows: int, vocab_major: bool | None = None) -> Any:
    """The engine's own lm_head product of `rows` rows (engine.model.step_logits; or in
    the layout `vocab_major` asks), jitted alone, as a 0-arg callable."""
    cfg = engine.model_config
    if vocab_major is not None:
        cfg = dataclasses.replace(cfg, vocab_major_head=vocab_major)
    x = jnp.ones((rows, cfg.hidden_size), engine.params["lm_head"].dtype)
    product = jax.jit(lambda params, x: step_logits(params, x, cfg))
    product(engine.params, x).block_until_ready()
    return lambda: product(engine.params, x).block_until_ready()


def bench_decode(engine: Engine, fill: int, steps: int, itemsize: int) -> dict[str, Any]:
    """Every slot holds a `fill`-token context; `steps` generate calls one by one, each
    followed by the lm_head product alone at the same number of rows, as the step runs it
    and (`hidden_major_`) as rows x (hidden, vocab)."""
    times = interleaved(
        {
            "step": Stepper(engine, fill),
            "head": lm_head_product(engine, engine.max_slots),
            "one": lm_head_product(engine, engine.max_slots, vocab_major=False),
        },
        steps,
    )
    step, head, one = times["step"], times["head"], times["one"]
    step_s = float(np.median(step))
    contexts = [fill + 1 + steps // 2] * engine.max_slots
    flops, nbytes = decode_work(engine.model_config, contexts, itemsize)
    return {
        "slots": engine.max_slots,
        "context": contexts[0],
        "step_ms": step_s * 1e3,
        "best_step_ms": min(step) * 1e3,
        "lm_head_ms": float(np.median(head)) * 1e3,
        "best_lm_head_ms": min(head) * 1e3,
        "step_over_lm_head": float(np.median(np.array(step) / np.array(head))),
        "step_over_lm_head_best": min(step) / min(head),
        "hidden_major_lm_head_ms": float(np.median(one)) * 1e3,
        "step_over_hidden_major_lm_head": float(np.median(np.array(step) / np.array(one))),
        "tokens_per_s": engine.max_slots / step_s,
        "work_gflop": flops / 1e9,
        "work_mbytes": nbytes / 1e6,
        "gflops": flops / step_s / 1e9,
    }


def bench_light_load(large: Engine, single: Engine, fill: int, steps: int) -> dict[str, Any]:
    """One busy slot on `large` against a 1-slot engine: time per output token of each."""
    times = interleaved(
        {"large": Stepper(large, fill, busy=1), "single": Stepper(single, fill)}, steps
    )
    large_s, single_s = np.array(times["large"]), np.array(times["single"])
    return {
        "slots": large.max_slots,
        "busy": 1,
        "step_ms": float(np.median(large_s)) * 1e3,
        "one_slot_engine_step_ms": float(np.median(single_s)) * 1e3,
        "ratio": float(np.median(large_s / single_s)),
        "ratio_best": float(large_s.min() / single_s.min()),
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
    fill = max_len // 2
    decode, engines = [], {}
    for count in sorted(set(slots) | {1}):
        config = EngineConfig(
            folder, dtype=dtype, max_slots=count, max_model_len=max_len,
            max_prefill_len=max_prefill,
        )  # fmt: skip
        engine = Engine(config)
        start = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - start
        if count == max(slots):
            cfg = engine.model_config
            result["matmul_params"] = matmul_params(cfg)
            result["warmup_s"] = warmup_s
            result["prefill"] = bench_prefill(engine, itemsize)
        if count in slots:
            decode.append(bench_decode(engine, fill, steps, itemsize))
        if count in (1, max(slots)):
            engines[count] = engine
    result["decode"] = decode
    if max(slots) > 1:
        result["light_load"] = bench_light_load(engines[max(slots)], engines[1], fill, steps)
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
            elif name == "128k":
                folder = build_llama_checkpoint(
                    Path(tmp) / "128k", 256, 4, 4, 2, 704, 128256,
                    max_position_embeddings=1024,
                )  # fmt: skip
                max_len, max_prefill = 256, 128
            else:
                raise SystemExit(f"unknown model {name!r} (tiny, 100m, 128k)")
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
