"""Orchestrator throughput: tokens/s through the stages vs the engine's own generate loop.

Run from the repository root:

    python -m bench.orchestrator_bench                 # tiny, 100m and fake
    python -m bench.orchestrator_bench --model 100m --slots 16

For a real checkpoint (tiny: hidden 64, 2 layers; 100m: a random ~100M-param
Llama written to a temp folder with the gpt2 test tokenizer) it prints, in one
run on the same engine and slot count:
  engine_tok_s        generate() back to back, every slot busy, no orchestrator
  orchestrator_tok_s  steady state through submit -> prefill -> generate ->
                      detokenize -> stream, measured while every slot is busy
  ratio               orchestrator_tok_s / engine_tok_s
For the fake engine (numpy, zero-cost steps) it prints the most tokens/s the
orchestrator itself can carry and its cost per token in microseconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.fake import FakeEngine, FakeTokenizer
from engine.orchestrator import Orchestrator, OrchestratorConfig
from engine.request import ActiveRequest, Delta, RequestStream
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)
GPT2_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpt2"
MODEL_100M = dict(
    hidden=768, layers=10, heads=12, kv_heads=4, intermediate=2048, vocab=50257
)  # ~102M params with tied embeddings


def write_checkpoint(model: str, folder: Path) -> Path:
    from engine.tiny import build_llama_checkpoint, write_tiny_checkpoint

    if model == "tiny":
        return write_tiny_checkpoint(folder, arch="llama", seed=0)
    path = build_llama_checkpoint(
        folder, **MODEL_100M, max_position_embeddings=512, tie_word_embeddings=True
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GPT2_TOKENIZER / name, path / name)
    return path


def engine_tok_s(engine: Any, steps: int) -> float:
    """Every slot busy, generate() dispatched back to back, one wait at the end."""
    import jax

    state = engine.init_state()
    prefix = engine.prefill(list(range(2, 10)), GREEDY)
    for slot in range(engine.max_slots):
        state = engine.insert(prefix, state, slot)
    state, out = engine.generate(state)
    jax.block_until_ready(out.tokens)
    started = time.perf_counter()
    for _ in range(steps):
        state, out = engine.generate(state)
    jax.block_until_ready(out.tokens)
    return engine.max_slots * steps / (time.perf_counter() - started)


def orchestrator_tok_s(engine: Any, tokenizer: Any, max_tokens: int) -> float:
    """Tokens/s while every slot is busy: from the last first token to the first finish."""
    streams_of = text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids)
    orch = Orchestrator(engine, streams_of, OrchestratorConfig(max_queued_samples=1024))
    orch.start()
    try:
        streams = [
            orch.submit(
                ActiveRequest(
                    f"r{i}", (2 + i % 50, 3, 4, 5, 6, 7, 8, 9), GREEDY, max_tokens, ignore_eos=True
                )
            )
            for i in range(engine.max_slots)
        ]
        deltas = [stream.collect(timeout=3600) for stream in streams]
    finally:
        orch.stop()
    return _full_occupancy_rate(streams, deltas)


def _full_occupancy_rate(streams: list[RequestStream], deltas: list[list[Delta]]) -> float:
    start = max(s.timings.first_token or 0.0 for s in streams)
    end = min(s.timings.finished or 0.0 for s in streams)
    tokens = sum(1 for ds in deltas for d in ds if start < d.emitted <= end)
    if end <= start or tokens == 0:
        raise RuntimeError("no window with every slot busy: raise --max-tokens")
    return tokens / (end - start)


def bench_model(model: str, slots: int, steps: int, rounds: int) -> dict[str, Any]:
    from engine.engine import Engine, EngineConfig
    from tokenization import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(model, Path(tmp))
        max_len = steps + 32
        engine = Engine(
            EngineConfig(
                model_path=str(path), max_slots=slots, max_model_len=max_len, prefill_buckets=(16,)
            )
        )
        engine.warmup()
        tokenizer = Tokenizer.from_folder(path)
    # alternate the two, so load from other processes hits both alike; report medians
    engine_rates, orch_rates = [], []
    for _ in range(rounds):
        engine_rates.append(engine_tok_s(engine, steps))
        orch_rates.append(orchestrator_tok_s(engine, tokenizer, max_tokens=steps))
    engine_rate, orch_rate = statistics.median(engine_rates), statistics.median(orch_rates)
    return {
        "model": model,
        "slots": slots,
        "steps": steps,
        "engine_tok_s": round(engine_rate, 1),
        "orchestrator_tok_s": round(orch_rate, 1),
        "ratio": round(orch_rate / engine_rate, 3),
        "engine_tok_s_rounds": [round(r, 1) for r in engine_rates],
        "orchestrator_tok_s_rounds": [round(r, 1) for r in orch_rates],
    }


def bench_fake(slots: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """The orchestrator's own ceiling: numpy engine, trivial detokenizer."""
    engine = FakeEngine(max_slots=slots, max_model_len=max_tokens + 16, prefill_buckets=(16,))
    tokenizer = FakeTokenizer()
    orch = Orchestrator(
        engine,
        text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids),
        OrchestratorConfig(max_queued_samples=requests),
    )
    orch.start()
    started = time.perf_counter()
    streams = [
        orch.submit(ActiveRequest(f"r{i}", (i % 97 + 1, 2, 3), GREEDY, max_tokens))
        for i in range(requests)
    ]
    total = sum(len(s.collect(timeout=3600)) for s in streams)
    elapsed = time.perf_counter() - started
    steps = orch.stats().generate_steps
    orch.stop()
    generate_s = _fake_generate_cost(engine, steps)
    return {
        "model": "fake",
        "slots": slots,
        "tokens": total,
        "orchestrator_tok_s": round(total / elapsed, 1),
        "us_per_token": round(1e6 * elapsed / total, 2),
        "fake_engine_share": round(generate_s / elapsed, 3),
    }


def _fake_generate_cost(engine: FakeEngine, steps: int) -> float:
    """Seconds the fake's own numpy step takes for `steps` steps (the not-quite-zero part)."""
    state = engine.init_state()
    state.active[:] = True
    started = time.perf_counter()
    for _ in range(steps):
        state.length[:] = 0
        engine.generate(state)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "100m", "fake", "all"), default="all")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--steps", type=int, default=96, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="engine/orchestrator alternations")
    parser.add_argument("--fake-requests", type=int, default=2000)
    args = parser.parse_args(argv)
    models = ("tiny", "100m", "fake") if args.model == "all" else (args.model,)
    for model in models:
        if model == "fake":
            result = bench_fake(args.slots, args.fake_requests, max_tokens=32)
        else:
            result = bench_model(model, args.slots, args.steps, args.rounds)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
