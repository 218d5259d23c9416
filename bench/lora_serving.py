"""LoRA serving benchmark: the base model alone against adapters mixed evenly.

Run from the repository root, on a quiet machine (the figures are ratios of one run):

    python -m bench.lora_serving --model CHECKPOINT --adapters 4 --concurrency 32 \
        --requests 128 --rounds 3 --out lora.json

Owns: writing `--adapters` random PEFT adapters (rank `--rank`, every projection) for the
checkpoint, then `--rounds` rounds. Each starts our server with all of them
(`--enable-lora`, `--max-loras` = the adapter count, run-time loading on) and sends it
the same requests twice in turn (the first rotating): to the base model at `--concurrency`, and
to the adapters, a share each at `--concurrency / adapters` (so `--concurrency` in flight
together, every batch mixing them); and each round the base requests once more to a
server started without LoRA ("plain"), one server up at a time, the first rotating.
Reports output tokens/s of each, per round, and the medians of lora / base, lora / plain
(the issue's bar: >= 0.8 at 4 adapters and c = 32) and base / plain, and the seconds a
run-time load of an adapter takes (POST /v1/load_lora_adapter, then unloaded; the median
of `--loads`). Nothing is sent but to this machine's loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import servers
from bench.loadgen import RunResult, Target, run_requests, vocabulary_of
from bench.workload import Length, RequestSpec, Workload, build_requests
from engine.config import load_model_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: Path, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter of `model` (every projection, rank `rank`) in `folder`."""
    from safetensors.numpy import save_file

    cfg = load_model_config(model)
    rng = np.random.default_rng(seed)
    kv = cfg.kv_size // cfg.kv_replicas
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {  # (in, out) of each projection
        "q_proj": (h, cfg.q_size), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (cfg.q_size, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    tensors = {}
    for i in range(cfg.num_layers):
        for target, (n_in, n_out) in shapes.items():
            where = "self_attn" if target in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{i}.{where}.{target}"
            a = rng.normal(0, 1 / np.sqrt(n_in), (rank, n_in)).astype(np.float32)
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.01, (n_out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "LORA"}))
    return folder


def tokens_per_s(results: list[RunResult], wall_s: float) -> tuple[float, int]:
    """Output tokens/s over the wall time of runs sent together, and their failures."""
    records = [r for result in results for r in result.records]
    failed = sum(1 for r in records if r.error)
    return sum(r.output_tokens for r in records) / wall_s, failed


async def send(
    base_url: str, models: list[str], specs: list[RequestSpec], concurrency: int
) -> dict:
    """`specs` split evenly over `models`, each share at its part of `concurrency`."""
    per = max(1, concurrency // len(models))
    shares = [specs[i :: len(models)] for i in range(len(models))]
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            run_requests(Target(base_url, m), share, concurrency=per, deadline_s=1800.0)
            for m, share in zip(models, shares, strict=True)
        )
    )
    wall = time.perf_counter() - started
    rate, failed = tokens_per_s(list(results), wall)
    return {"models": models, "output_tokens_per_s": rate, "failed": failed, "wall_s": wall}


def load_seconds(base_url: str, name: str, path: Path, count: int) -> list[float]:
    """Seconds of each of `count` run-time loads of the adapter (each unloaded after)."""
    out = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for _ in range(count):
            begun = time.perf_counter()
            loaded = client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            )
            out.append(time.perf_counter() - begun)
            loaded.raise_for_status()
            client.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    adapters = {
        f"lora{i}": write_adapter(args.model, args.adapter_dir / f"lora{i}", args.rank, i)
        for i in range(args.adapters)
    }
    plain = servers.ours(args.dtype)
    extra = ("--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
             "--enable-runtime-lora-updating", "--lora-modules",
             *(f"{n}={p}" for n, p in adapters.items()))  # fmt: skip
    with_lora = servers.ServerSpec(plain.name, (*plain.argv, *extra), plain.ready_path, plain.env)
    prompt, output = args.prompt_tokens, args.output_tokens
    workload = Workload("lora", Length(prompt, prompt), Length(output, output))
    specs = build_requests(workload, args.requests, vocabulary_of(args.model), seed=0)
    rounds, loads = [], []

    def on(spec: servers.ServerSpec, groups: list[list[str]], timed: bool) -> dict[str, dict]:
        """One server up: warmed, then each group of models sent the requests in turn."""
        nonlocal loads
        with servers.started(spec, args.model, "base", args.concurrency, args.context) as up:
            v1 = up.base_url + "/v1"
            every = sorted({m for group in groups for m in group})
            asyncio.run(send(v1, every, specs[: args.concurrency], args.concurrency))
            runs = [asyncio.run(send(v1, group, specs, args.concurrency)) for group in groups]
            if timed:
                loads = load_seconds(up.base_url, "extra", adapters["lora0"], args.loads)
        pairs = zip(groups, runs, strict=True)
        return {"base" if group == ["base"] else "lora": run for group, run in pairs}

    def lora_server(r: int) -> dict[str, dict]:
        groups = [["base"], list(adapters)]
        return on(with_lora, groups[::-1] if r % 2 else groups, r == args.rounds - 1)

    def plain_server(r: int) -> dict[str, dict]:
        return {"plain": on(plain, [["base"]], False)["base"]}

    for r in range(args.rounds):  # one server up at a time, the first rotating
        first, second = (lora_server, plain_server) if r % 2 == 0 else (plain_server, lora_server)
        runs = first(r) | second(r)
        rate = {k: v["output_tokens_per_s"] for k, v in runs.items()}
        ratios = {
            "lora_over_base": rate["lora"] / rate["base"],
            "lora_over_plain": rate["lora"] / rate["plain"],
            "base_over_plain": rate["base"] / rate["plain"],
        }
        rounds.append(runs | ratios)
    return {
        "setup": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"model": args.model.name, "adapter_dir": None, "out": None},
        "rounds": rounds,
        **{
            k + "_median": statistics.median(r[k] for r in rounds)
            for k in ("lora_over_base", "lora_over_plain", "base_over_plain")
        },
        "load_s": loads,
        "load_s_median": statistics.median(loads),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="per run")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024, help="max model length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loads", type=int, default=5, help="run-time loads timed")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--adapter-dir", type=Path, required=True, help="where adapters go")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    keys = ("lora_over_base_median", "lora_over_plain_median", "load_s_median")
    print(json.dumps({k: report[k] for k in keys}))
    return report


if __name__ == "__main__":
    main()
