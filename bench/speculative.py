"""Speculative decoding (n-gram) against the same server without it, through HTTP.

Run: `python -m bench.speculative --model 100m [--context 512] [--max-num-seqs 32]
[--rounds 2] [--config JSON] [--draft-layers N] [--json PATH]`. --model is a checkpoint
folder or a name bench.models builds.

Servers, ours without and with `--speculative-config` (default n-gram, 4 tokens, lookup
1-3) and, with --draft-layers N, with a draft model cut down from the served one (its
first N layers, embedding and head: `cut_down`, 3 tokens), one up at a time, the order
rotating from round to round. Each runs:
- `copy`, c = 1: 6 greedy requests one after another, random 64-token prompts, 128 tokens
  out (ignore_eos). The benchmark checkpoints have random weights and greedy decoding
  falls into loops in them part of the time (on 100m, about 40% of next tokens are what a
  1-3 token lookup predicts). TPOT per request: (last chunk - first chunk) / (tokens - 1),
  median.
- `loop`, c = 1: the copy-heavy case, prompts whose continuation repeats text from the
  prompt. Built once, before the rounds, with the plain server: each random 64-token
  prompt's greedy continuation (up to the context) is searched for the first point from
  which the next 128 tokens are what a 1-3 token lookup predicts at least 80% of the time;
  the prompt is the random tokens plus the continuation up to that point (`looping`).
  The first 6 random prompts that have such a point are used; same TPOT as `copy`.
- `random`, c = 32: the random_64 workload (128 random tokens in, 64 out, 4 x 32 requests):
  output tokens/s.
Then the server's spec_decode counters (/metrics): drafts, draft tokens, accepted tokens.
Reported: TPOT at c = 1 and tokens/s at c = 32, speculation over none, per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.loadgen import Target, run_requests
from bench.report import emit
from bench.run_serving import checkpoint
from bench.servers import ServerSpec, ours, started
from bench.workload import RequestSpec
from engine.core.speculation import propose_ngram

DEFAULT_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
    '"prompt_lookup_min": 1}'
)
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def prompts(rng: np.random.Generator, vocab: int, count: int, tokens: int, out: int) -> list:
    return [
        RequestSpec(i, tuple(int(t) for t in rng.integers(10, vocab - 10, tokens)), out)
        for i in range(count)
    ]


def spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for name in COUNTERS:
        found = re.search(rf"^llm_spec_decode_{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    return out


def cut_down(target: Path, into: Path, layers: int) -> Path:
    """A draft checkpoint: the target's first `layers` layers with its embedding, final norm
    and head (and its tokenizer files), as safetensors."""
    from safetensors.numpy import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(config))
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(target.glob("*.safetensors")):
        for name, value in load_file(file).items():
            index = re.match(r"model\.layers\.(\d+)\.", name)
            if index is None or int(index.group(1)) < layers:
                tensors[name] = value
    save_file(tensors, str(into / "model.safetensors"))
    for extra in target.iterdir():
        if (
            extra.suffix != ".safetensors"
            and extra.name not in ("config.json",)
            and (extra.is_file() and not extra.name.endswith(".index.json"))
        ):
            (into / extra.name).write_bytes(extra.read_bytes())
    return into


def predicted(tokens: Sequence[int], start: int, count: int) -> float:
    """Fraction of tokens[start:start+count] that an n-gram lookup (lengths 1-3) of the
    tokens before each proposes as its next token."""
    hits = [propose_ngram(tokens[:j], 1, 1, 3) == [tokens[j]] for j in range(start, start + count)]
    return sum(hits) / count


def loop_start(tokens: Sequence[int], first: int, out: int, share: float) -> int | None:
    """The first cut (from `first`, in steps of 8) after which `share` of the next `out`
    tokens are what the lookup predicts; None where there is none."""
    for cut in range(first, len(tokens) - out + 1, 8):
        if predicted(tokens, cut, out) >= share:
            return cut
    return None


def looping(
    base_url: str, name: str, random: list, context: int, out: int, want: int
) -> list[RequestSpec]:
    """`want` copy-heavy prompts (module docstring): random prompts extended by their own
    greedy continuation up to where the next `out` tokens repeat earlier text."""
    found: list[RequestSpec] = []
    for spec in random:
        body = {
            "model": name,
            "prompt": list(spec.prompt),
            "max_tokens": context - len(spec.prompt) - 1,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = httpx.post(base_url + "/v1/completions", json=body, timeout=900).json()
        tokens = list(spec.prompt) + reply["choices"][0]["token_ids"]
        cut = loop_start(tokens, len(spec.prompt), out, 0.8)
        if cut is not None:
            found.append(RequestSpec(len(found), tuple(tokens[:cut]), out))
        if len(found) == want:
            return found
    raise RuntimeError(f"only {len(found)} of {len(random)} prompts loop; want {want}")


def one_server(running_url: str, name: str, copy: list, loop: list, random: list) -> dict[str, Any]:
    target = Target(running_url + "/v1", name)
    asyncio.run(run_requests(target, copy[:1], concurrency=1, deadline_s=600))  # warm
    before = spec_counters(running_url)
    tpots = {}
    records = []
    for label, specs in (("copy", copy), ("loop", loop)):
        done = asyncio.run(run_requests(target, specs, concurrency=1, deadline_s=900))
        records += done.records
        tpots[label] = [r.tpot_s for r in done.records if r.ok and r.tpot_s is not None]
    spread = asyncio.run(run_requests(target, random, concurrency=32, deadline_s=900))
    failed = [r.error for r in records + spread.records if r.error]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:3]}")
    after = spec_counters(running_url)
    tokens = sum(r.output_tokens for r in spread.records)
    return {
        "tpot_c1_ms": statistics.median(tpots["copy"]) * 1e3,
        "tpot_c1_loop_ms": statistics.median(tpots["loop"]) * 1e3,
        "tok_per_s_c32": tokens / spread.duration_s,
        **{k: after[k] - before[k] for k in COUNTERS},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="100m")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="--speculative-config JSON")
    parser.add_argument("--draft-layers", type=int, default=0, help="also a cut-down draft")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    folder, name = checkpoint(args.model, args.context)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    plain = ours()

    def speculating(name: str, config: str) -> ServerSpec:
        escaped = config.replace("{", "{{").replace("}", "}}")  # argv is a format template
        argv = (*plain.argv, "--speculative-config", escaped)
        return ServerSpec(name, argv, plain.ready_path, plain.env)

    servers = [plain, speculating("ngram", args.config)]
    if args.draft_layers:
        draft = cut_down(
            folder, folder.parent / f"{folder.name}-draft{args.draft_layers}", args.draft_layers
        )
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        servers.append(speculating("draft", json.dumps(config)))
    rng = np.random.default_rng(0)
    copy = prompts(rng, vocab, 6, 64, 128)
    random = prompts(rng, vocab, 4 * 32, 128, 64)
    with started(plain, folder, name, args.max_num_seqs, args.context) as running:
        loop = looping(
            running.base_url, name, prompts(rng, vocab, 32, 64, 128), args.context, 128, 6
        )
    print(json.dumps({"loop_prompt_tokens": [len(s.prompt) for s in loop]}), flush=True)
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        result: dict[str, Any] = {}
        for spec in servers[k % len(servers) :] + servers[: k % len(servers)]:
            with started(spec, folder, name, args.max_num_seqs, args.context) as running:
                result[spec.name] = one_server(running.base_url, name, copy, loop, random)
        for spec in servers[1:]:
            result[f"tpot_c1_{spec.name}_over_none"] = (
                result[spec.name]["tpot_c1_ms"] / result["ours"]["tpot_c1_ms"]
            )
            result[f"tpot_c1_loop_{spec.name}_over_none"] = (
                result[spec.name]["tpot_c1_loop_ms"] / result["ours"]["tpot_c1_loop_ms"]
            )
            result[f"tok_per_s_c32_{spec.name}_over_none"] = (
                result[spec.name]["tok_per_s_c32"] / result["ours"]["tok_per_s_c32"]
            )
        rounds.append(result)
        print(json.dumps({"round": k, **result}), flush=True)
    report = {
        "model": name,
        "context": args.context,
        "config": args.config,
        "draft_layers": args.draft_layers,
        "rounds": rounds,
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
