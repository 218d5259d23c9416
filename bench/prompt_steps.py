"""Engine-only prompt time: how long the engine core takes from prompts added to their
first tokens.

Run: `python -m bench.prompt_steps [--model DIR|NAME] [--shapes 1x128,1x256,8x128]
[--repeats 5] [--max-model-len 512] [--chunk 256]` prints one JSON object.

No server, no client, no tokenizer: an EngineCore in this process (prefix cache off, so
every repeat computes its whole prompts), for each shape NxL, N prompts of L distinct
tokens added at once with max_tokens 1 and stepped until all have ended. The figure is
the median over `repeats` timed runs after one untimed one (the engine part of a
server's time to first token, at c = 1 for 1xL, and for N prompts that arrive together
otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x128,8x128' -> [(1, 128), (8, 128)]."""
    shapes = []
    for part in text.split(","):
        count, _, length = part.strip().partition("x")
        if not (count.isdigit() and length.isdigit()) or int(count) < 1 or int(length) < 1:
            raise ValueError(f"a shape is COUNTxLENGTH, got {part!r}")
        shapes.append((int(count), int(length)))
    return shapes


def prompt_ms(
    model: str,
    shapes: list[tuple[int, int]],
    repeats: int,
    max_model_len: int,
    chunk: int,
    dtype: str = "float32",
) -> dict[str, Any]:
    from engine.core.core import CoreConfig, EngineCore
    from engine.core.scheduler import SequenceState
    from engine.types import SamplingParams

    slots = max(count for count, _ in shapes)
    core = EngineCore(
        CoreConfig(
            model_path=model, dtype=dtype, max_num_seqs=slots, max_model_len=max_model_len,
            max_num_batched_tokens=chunk + slots, chunk_size=chunk, prefix_caching=False,
        )
    )  # fmt: skip
    core.warmup()
    greedy = SamplingParams(temperature=0.0, seed=0)
    vocab = core.model_config.vocab_size
    medians, runs = {}, {}
    for count, length in shapes:
        times = []
        for r in range(repeats + 1):  # the first run warms the caches
            started = time.perf_counter()
            for i in range(count):
                prompt = tuple((7 * k + 31 * i + r) % vocab for k in range(length))
                core.add(SequenceState(f"{count}x{length}-{r}-{i}", prompt, greedy, 1))
            while core.scheduler.busy:
                core.step()
            times.append(1e3 * (time.perf_counter() - started))
        name = f"{count}x{length}"
        runs[name] = [round(t, 1) for t in times[1:]]
        medians[name] = round(statistics.median(times[1:]), 1)
    return {"dtype": dtype, "chunk": chunk, "ms": medians, "ms_runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="checkpoint folder or a bench.models name"
    )
    parser.add_argument("--shapes", default="1x128,1x256,8x128", help="COUNTxLENGTH, ...")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    from bench.run_serving import checkpoint

    model, _ = checkpoint(args.model, args.max_model_len)
    result = prompt_ms(
        str(model), parse_shapes(args.shapes), args.repeats, args.max_model_len, args.chunk,
        args.dtype,
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
