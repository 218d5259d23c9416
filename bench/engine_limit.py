"""Engine-only limit: output tokens/s of the jitted generate loop with every slot busy.

Run: `python -m bench.engine_limit --model DIR --slots 32 --max-model-len 1024 \
--prompt-len 128 --steps 128` prints one JSON object.

No server, no orchestrator, no tokenizer: every slot is filled with one
`prompt-len` prefill, then `steps` generate calls are dispatched back to back
and waited for once at the end (the loop the orchestrator runs, minus its
hand-offs). The contexts grow from prompt-len as a serving run's do. The
figure is the median of `rounds` such runs. The serving runner starts this in
its own process, before and after the servers, so the two never share cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def engine_tok_s(
    model: str, slots: int, max_model_len: int, prompt_len: int, steps: int, rounds: int, dtype: str
) -> dict[str, Any]:
    import jax

    from engine.engine import Engine, EngineConfig
    from engine.types import SamplingParams

    if prompt_len + steps + 1 > max_model_len:
        raise ValueError(f"prompt_len + steps must fit max_model_len ({max_model_len})")
    bucket = 16
    while bucket < prompt_len:
        bucket *= 2
    engine = Engine(
        EngineConfig(
            model_path=model, dtype=dtype, max_slots=slots, max_model_len=max_model_len,
            prefill_buckets=(min(bucket, max_model_len - 1),),
        )
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, seed=0)
    prompt = [(7 * i + 3) % engine.vocab_size for i in range(prompt_len)]
    prefix = engine.prefill(prompt, greedy)
    rates = []
    for _ in range(rounds + 1):  # the first round compiles and warms caches
        state = engine.init_state()
        for slot in range(slots):
            state = engine.insert(prefix, state, slot)
        jax.block_until_ready(state)
        started = time.perf_counter()
        for _ in range(steps):
            state, out = engine.generate(state)
        jax.block_until_ready(out.tokens)
        rates.append(slots * steps / (time.perf_counter() - started))
    rates = rates[1:]
    return {
        "slots": slots,
        "prompt_len": prompt_len,
        "steps": steps,
        "dtype": dtype,
        "tok_per_s": statistics.median(rates),
        "tok_per_s_rounds": rates,
        "step_ms": 1e3 * slots / statistics.median(rates),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    result = engine_tok_s(
        args.model, args.slots, args.max_model_len, args.prompt_len, args.steps, args.rounds,
        args.dtype,
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
