"""Structured-output cost at full occupancy: what constrained requests cost their neighbours.

Run from the repository root:

    python -m bench.structured_bench                     # tiny checkpoint, 16 slots
    python -m bench.structured_bench --model 100m --constrained 4

Every slot is busy with a request that runs its whole budget (ignore_eos; the
constrained ones follow the regex `[a-z]+` with min_tokens = max_tokens, so their
grammar never completes and EOS is held back). Two runs per round, alternated so
load from other processes hits both alike, medians over rounds:
  plain       every slot unconstrained
  mixed       `--constrained` slots under the grammar, the rest unconstrained
It prints:
  neighbour_tok_s_plain / _mixed  tokens/s of the unconstrained requests the two runs
                                  share, while every slot is busy (target: mixed
                                  within 5% of plain)
  itl_ms_plain / itl_ms_constrained  median inter-token latency of an unconstrained
                                  request (plain run) and of a constrained one (mixed
                                  run; target within 1.5x)
  mask_us_per_token               the grammar worker's time per constrained token
                                  (matcher advance + next mask)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.orchestrator_bench import write_checkpoint
from engine.orchestrator import Orchestrator, OrchestratorConfig
from engine.request import ActiveRequest, Delta, RequestStream
from engine.stages.detokenize import text_streams
from engine.types import SamplingParams

PATTERN = "[a-z]+"


def run(
    engine: Any, tokenizer: Any, grammar: Any, slots: int, constrained: int, max_tokens: int
) -> dict[str, Any]:
    """One full-occupancy run; requests 0..constrained-1 follow the grammar."""
    streams_of = text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids)
    orch = Orchestrator(engine, streams_of, OrchestratorConfig(max_queued_samples=1024))
    orch.start()
    try:
        streams = []
        for i in range(slots):
            constraint = grammar if i < constrained else None
            sampling = SamplingParams(
                temperature=0.0,
                seed=i,
                min_tokens=max_tokens if constraint is not None else 0,
                constraint=constraint,
            )
            prompt = (2 + i % 50, 3, 4, 5, 6, 7, 8, 9)
            request = ActiveRequest(f"r{i}", prompt, sampling, max_tokens, ignore_eos=True)
            streams.append(orch.submit(request))
        deltas = [stream.collect(timeout=3600) for stream in streams]
        worker = orch._generate.grammar
        mask = (worker.mask_seconds, worker.tokens) if worker is not None else (0.0, 0)
    finally:
        orch.stop()
    return {"streams": streams, "deltas": deltas, "mask": mask}


def window_rate(streams: list[RequestStream], deltas: list[list[Delta]], only: range) -> float:
    """Tokens/s of the requests in `only` while every request is running."""
    start = max(s.timings.first_token or 0.0 for s in streams)
    end = min(s.timings.finished or 0.0 for s in streams)
    tokens = sum(1 for i in only for d in deltas[i] if start < d.emitted <= end)
    if end <= start or tokens == 0:
        raise RuntimeError("no window with every slot busy: raise --max-tokens")
    return tokens / (end - start)


def median_itl_ms(deltas: list[list[Delta]], only: range) -> float:
    gaps = [
        (b.emitted - a.emitted) * 1e3
        for i in only
        for a, b in zip(deltas[i][5:], deltas[i][6:], strict=False)  # past the ramp-up
    ]
    return statistics.median(gaps)


def bench(model: str, slots: int, constrained: int, max_tokens: int, rounds: int) -> dict:
    from engine.engine import Engine, EngineConfig
    from tokenization import Tokenizer
    from tokenization.grammar import GrammarSpec

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(model, Path(tmp))
        engine = Engine(
            EngineConfig(
                model_path=str(path),
                max_slots=slots,
                max_model_len=max_tokens + 32,
                prefill_buckets=(16,),
            )
        )
        engine.warmup()
        tokenizer = Tokenizer.from_folder(path)
        grammar = tokenizer.grammar_compiler(engine.vocab_size).compile(
            GrammarSpec("regex", PATTERN)
        )
    neighbours = range(constrained, slots)
    plain_rates, mixed_rates, plain_itl, constrained_itl, mask_us = [], [], [], [], []
    for _ in range(rounds):
        plain = run(engine, tokenizer, grammar, slots, 0, max_tokens)
        mixed = run(engine, tokenizer, grammar, slots, constrained, max_tokens)
        plain_rates.append(window_rate(plain["streams"], plain["deltas"], neighbours))
        mixed_rates.append(window_rate(mixed["streams"], mixed["deltas"], neighbours))
        plain_itl.append(median_itl_ms(plain["deltas"], neighbours))
        constrained_itl.append(median_itl_ms(mixed["deltas"], range(constrained)))
        seconds, tokens = mixed["mask"]
        mask_us.append(1e6 * seconds / max(tokens, 1))
        text = "".join(d.text for d in mixed["deltas"][0])
        if not text.isalpha() or not text.islower():
            raise RuntimeError(f"a constrained output broke its grammar: {text[:40]!r}")
    plain_rate, mixed_rate = statistics.median(plain_rates), statistics.median(mixed_rates)
    itl_plain, itl_constrained = statistics.median(plain_itl), statistics.median(constrained_itl)
    return {
        "model": model,
        "slots": slots,
        "constrained": constrained,
        "max_tokens": max_tokens,
        "neighbour_tok_s_plain": round(plain_rate, 1),
        "neighbour_tok_s_mixed": round(mixed_rate, 1),
        "neighbour_ratio": round(mixed_rate / plain_rate, 3),
        # each round's two runs were back to back: their ratio sees the same load
        "neighbour_ratio_paired": round(
            statistics.median(m / p for m, p in zip(mixed_rates, plain_rates, strict=True)), 3
        ),
        "itl_ms_plain": round(itl_plain, 2),
        "itl_ms_constrained": round(itl_constrained, 2),
        "itl_ratio": round(itl_constrained / itl_plain, 3),
        "mask_us_per_token": round(statistics.median(mask_us), 1),
        "rounds": {
            "neighbour_tok_s_plain": [round(r, 1) for r in plain_rates],
            "neighbour_tok_s_mixed": [round(r, 1) for r in mixed_rates],
            "itl_ms_plain": [round(r, 2) for r in plain_itl],
            "itl_ms_constrained": [round(r, 2) for r in constrained_itl],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "100m"), default="tiny")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = bench(args.model, args.slots, args.constrained, args.max_tokens, args.rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
