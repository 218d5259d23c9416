"""Quantization report: bytes, sequences that fit, CPU decode step time and error per mode.

Run: `python -m bench.quant_report --model 100m --out bench/results/quant` (or
`--model 70m-128k`); writes MODEL.json and MODEL.md there and prints the table.

For each mode (--quantization x --kv-cache-dtype, the model in bfloat16):
- weight_bytes: the engine core's params (EngineCore.weight_bytes, what /metrics exports
  as llm_engine_memory_bytes{pool="weights"}), and the ratio to bfloat16's;
- kv_token_bytes: one position's K and V over every layer, and the ratio to bfloat16's;
- seqs_fit: max-length sequences (--max-model-len) the KV pages of a fixed byte budget
  (--kv-budget) hold, as the engine core counts them (engine.core.memory);
- decode_ms: the median CPU time of an engine core step with --seqs sequences all
  decoding (after every shape compiled), and the ratio to bfloat16's, in a core with
  only the pages they reach (`timing_pages`: on XLA:CPU a step with 16-bit or fp8 pages
  takes time in proportion to the whole cache, bench/README.md); the cores are
  shared with whatever else runs (bench/README.md says what did);
- rel_logits_error, kl, top1: against the unquantized model in float32, teacher-forced
  over a fixed text (engine.quant_eval; the bfloat16 row is bfloat16's own error).

Checkpoints: the benchmark shapes of bench.models with random weights. The text is the
tiny corpus (engine.tiny_corpus) in GPT-2's tokenizer (bundled with the tests) for both:
70m-128k's Llama 3 tokenizer is not needed for an error over token ids, so its
checkpoint is built without it (engine.tiny.build_llama_checkpoint) and reads the same
GPT-2 ids (all inside its vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = (
    ("none", "auto"),
    ("int8", "auto"),
    ("none", "int8"),
    ("none", "fp8"),
    ("none", "fp8_e5m2"),
    ("int8", "int8"),
    ("int8", "fp8"),
)
MIB = 1 << 20


@dataclass
class Row:
    quantization: str
    kv_cache_dtype: str
    weight_bytes: int
    weight_ratio: float
    kv_token_bytes: int
    kv_ratio: float
    seqs_fit: int
    decode_ms: float
    decode_ratio: float
    rel_logits_error: float
    kl: float
    top1: float


def checkpoint(model: str, folder: Path) -> Path:
    from bench.models import SHAPES, build
    from engine.tiny import build_llama_checkpoint

    if model == "70m-128k":
        s = SHAPES[model]
        return build_llama_checkpoint(
            folder, s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab,
            max_position_embeddings=1024, tie_word_embeddings=s.tied,
        )  # fmt: skip
    return build(model, folder)


def text_tokens(length: int) -> list[int]:
    from bench.models import GPT2_TOKENIZER
    from engine.tiny_corpus import CORPUS
    from tokenization import Tokenizer

    ids = Tokenizer.from_folder(GPT2_TOKENIZER).encode(CORPUS)
    while len(ids) < length:
        ids = ids + ids
    return list(ids[:length])


def decode_step_ms(core: object, seqs: int, prompt_len: int, steps: int) -> float:
    from engine.core.scheduler import SequenceState
    from engine.types import SamplingParams

    # greedy, and no end before the timed steps are done (min_tokens holds EOS back)
    length = steps + seqs + 8  # the first ones start seqs steps before the last
    greedy = SamplingParams(temperature=0.0, seed=0, min_tokens=length)
    for i in range(seqs):
        prompt = tuple((7 * i + 11 * j + 3) % 50000 for j in range(prompt_len))
        core.add(SequenceState(f"d{i}", prompt, greedy, length))  # type: ignore[attr-defined]
    emitted: dict[str, int] = {}
    while len(emitted) < seqs or min(emitted.values()) < 3:  # every one decoding, compiled
        for event in core.step():  # type: ignore[attr-defined]
            emitted[event.seq_id] = emitted.get(event.seq_id, 0) + 1
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        events = core.step()  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
        if len(events) != seqs:
            raise RuntimeError(f"a timed step decoded {len(events)} of {seqs} sequences")
    return statistics.median(times) * 1e3


def timing_pages(args: argparse.Namespace, page_size: int = 16) -> int:
    """The timed core's pages: what its sequences reach, beside one max-length sequence
    (the least a core takes)."""
    reach = args.prompt_len + args.steps + args.seqs + 8
    return -(-args.max_model_len // page_size) + args.seqs * -(-reach // page_size)


def report(args: argparse.Namespace) -> list[Row]:
    import jax

    from engine.checkpoint import load_params
    from engine.config import load_model_config
    from engine.core.core import CoreConfig, EngineCore
    from engine.core.memory import KVBudget, pages_for_budget
    from engine.quant import quantize_params
    from engine.quant_eval import compare, teacher_forced_logits

    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoint(args.model, Path(tmp))
        cfg = load_model_config(folder)
        tokens = text_tokens(args.text_len)
        f32 = jax.device_put(load_params(folder, cfg, "float32"))
        reference = teacher_forced_logits(f32, cfg, tokens)
        del f32
        bf16 = jax.device_put(load_params(folder, cfg, "bfloat16"))
        rows: list[Row] = []
        base: Row | None = None
        for quantization, kv in MODES:
            params = quantize_params(bf16, quantization)
            logits = teacher_forced_logits(params, cfg, tokens, kv_cache_dtype=kv)
            error = compare(reference, logits)
            del params, logits
            core = EngineCore(
                CoreConfig(
                    model_path=folder, dtype="bfloat16", max_num_seqs=args.seqs,
                    max_model_len=args.max_model_len, max_num_batched_tokens=max(64, args.seqs),
                    chunk_size=64, num_pages=timing_pages(args),
                    quantization=quantization, kv_cache_dtype=kv,
                )
            )  # fmt: skip
            layout = core.runner.layout
            per_seq = -(-args.max_model_len // layout.page_size)
            budget = KVBudget(kv_cache_memory_bytes=args.kv_budget)
            fit = pages_for_budget(budget, layout, cfg.num_layers, core.mesh) // per_seq
            ms = decode_step_ms(core, args.seqs, args.prompt_len, args.steps)
            token_bytes = layout.token_bytes * cfg.num_layers
            row = Row(
                quantization, kv, core.weight_bytes, 1.0, token_bytes, 1.0,
                fit, round(ms, 2), 1.0,
                round(error.rel_logits_error, 5), float(f"{error.kl:.3g}"), round(error.top1, 4),
            )  # fmt: skip
            if base is None:
                base = row
            row.weight_ratio = round(row.weight_bytes / base.weight_bytes, 3)
            row.kv_ratio = round(row.kv_token_bytes / base.kv_token_bytes, 3)
            row.decode_ratio = round(row.decode_ms / base.decode_ms, 2)
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
            del core
    return rows


def markdown(model: str, args: argparse.Namespace, rows: list[Row]) -> str:
    head = (
        f"{model} in bfloat16; KV budget {args.kv_budget // MIB} MiB at max_model_len "
        f"{args.max_model_len}; decode step of {args.seqs} sequences on CPU "
        f"({timing_pages(args)} pages); error over "
        f"{args.text_len} tokens against float32\n\n"
        "| weights | KV | weight bytes | x bf16 | KV bytes/token | x bf16 | seqs fit "
        "| decode ms | x bf16 | rel. logits error | KL (nats) | top-1 |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.quantization} | {r.kv_cache_dtype} | {r.weight_bytes:,} | {r.weight_ratio} "
        f"| {r.kv_token_bytes:,} | {r.kv_ratio} | {r.seqs_fit} | {r.decode_ms} "
        f"| {r.decode_ratio} | {r.rel_logits_error} | {r.kl} | {r.top1} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("100m", "70m-128k"), default="100m")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--text-len", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-budget", type=int, default=64 * MIB, help="for seqs_fit")

    args = parser.parse_args(argv)
    rows = report(args)
    table = markdown(args.model, args, rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"setup": vars(args) | {"out": str(args.out)}, "rows": [asdict(r) for r in rows]}
        (args.out / f"{args.model}.json").write_text(json.dumps(data, indent=1))
        (args.out / f"{args.model}.md").write_text(table)


if __name__ == "__main__":
    main()
