"""Engine-only limit: output tokens/s of the engine core's steps with every row decoding.

Run: `python -m bench.engine_limit [--model DIR|NAME] --slots 32 --max-model-len 1024 \
--prompt-len 128 --steps 128` prints one JSON object.

No server, no client, no tokenizer: an EngineCore in this process, `slots` sequences of
one `prompt-len` prompt added at once and stepped until every one decodes (the prefix
cache makes every prompt after the first a hit), then `steps` more steps timed (the
scheduler's plan, the runner's step and its host copy, with one step in flight as the
core's loop runs them unless `--no-async-scheduling`: that loop minus its sockets). The
contexts grow from prompt-len as a serving run's do. The figure is the median of `rounds`
such runs; `host_cpu_ms_per_step` is the median of this thread's CPU a step over them (the
host's share of each step). The serving runner starts this in its own process, before and
after the servers, so the two never share cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def timed_steps(core: Any, steps: int) -> tuple[float, float]:
    """(seconds, this thread's CPU seconds) for `steps` steps, dispatched as
    engine.core.loop does: the next before waiting for the one in flight, when the core
    schedules asynchronously. The CPU is the host's work (planning, preparing,
    dispatching, taking the tokens), which on XLA:CPU shares the cores with the steps."""
    ahead = core.config.async_scheduling
    started, cpu = time.perf_counter(), time.thread_time()
    pending = core.launch()
    for _ in range(steps - 1):
        following = core.launch(ahead=True) if ahead else None
        core.finish(pending)
        pending = following if following is not None else core.launch()
    core.finish(pending)
    return time.perf_counter() - started, time.thread_time() - cpu


def engine_tok_s(
    model: str,
    slots: int,
    max_model_len: int,
    prompt_len: int,
    steps: int,
    rounds: int,
    dtype: str,
    async_scheduling: bool = True,
) -> dict[str, Any]:
    from engine.core.core import CoreConfig, EngineCore
    from engine.core.scheduler import SequenceState
    from engine.types import SamplingParams

    if prompt_len + steps + 2 > max_model_len:
        raise ValueError(f"prompt_len + steps must fit max_model_len ({max_model_len})")
    core = EngineCore(
        CoreConfig(
            model_path=model, dtype=dtype, max_num_seqs=slots, max_model_len=max_model_len,
            max_num_batched_tokens=max(256, slots), chunk_size=256,
            async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    core.warmup()
    greedy = SamplingParams(temperature=0.0, seed=0)
    vocab = core.model_config.vocab_size
    prompt = tuple((7 * i + 3) % vocab for i in range(prompt_len))
    rates, host = [], []
    for r in range(rounds + 1):  # the first round warms the caches
        for i in range(slots):
            core.add(SequenceState(f"{r}-{i}", prompt, greedy, steps + 2))
        while any(s.computed < len(s.tokens) - 1 for s in core.scheduler.running) or (
            core.scheduler.waiting
        ):
            core.step()  # every prompt in, every row decoding
        seconds, cpu = timed_steps(core, steps)
        rates.append(slots * steps / seconds)
        host.append(1e3 * cpu / steps)
        while core.scheduler.busy:
            core.step()
    rates, host = rates[1:], host[1:]
    return {
        "slots": slots,
        "prompt_len": prompt_len,
        "steps": steps,
        "dtype": dtype,
        "async_scheduling": async_scheduling,
        "tok_per_s": statistics.median(rates),
        "tok_per_s_rounds": rates,
        "step_ms": 1e3 * slots / statistics.median(rates),
        "host_cpu_ms_per_step": statistics.median(host),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="checkpoint folder or a bench.models name"
    )
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--no-async-scheduling", dest="async_scheduling", action="store_false",
        help="one step at a time (the core's --no-async-scheduling)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from bench.run_serving import checkpoint

    model, _ = checkpoint(args.model, args.max_model_len)
    result = engine_tok_s(
        str(model), args.slots, args.max_model_len, args.prompt_len, args.steps, args.rounds,
        args.dtype, args.async_scheduling,
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
