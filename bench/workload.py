"""Serving workloads: a small JSON format, its validation, and the prompts it draws.

Owns: what a benchmark sends (prompt token ids, output length, arrival times),
never how it is sent (bench.loadgen) or measured (bench.metrics). A workload
file looks like:

    {
      "name": "chat",
      "description": "short prompts behind a shared system prompt",
      "prompt": {"shared_prefix_tokens": 64, "tokens": {"uniform": [16, 96]},
                 "source": "random"},
      "output_tokens": {"fixed": 128},
      "arrival": {"mode": "concurrency"},
      "requests": {"per_concurrency": 4, "min": 8, "max": 256}
    }

Lengths are `{"fixed": n}`, `{"uniform": [lo, hi]}` (inclusive) or
`{"context_fraction": f}` (f x the server's context length, resolved when the
server is known). `prompt.tokens` counts the tokens after the shared prefix.
`arrival.mode` is `concurrency` (a fixed number in flight; the runner sweeps
it), `poisson` (`rate` requests/s, exponential gaps, optionally capped by the
swept concurrency) or `burst` (every request at t=0). `source` is `random`
(token ids drawn uniformly from the vocabulary less its special tokens, sent as
a token-id prompt, as vLLM's random dataset does) or `text` (slices of a
bundled English text, tokenized by the checkpoint's tokenizer).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
ARRIVAL_MODES = ("concurrency", "poisson", "burst")
SOURCES = ("random", "text")


@dataclass(frozen=True)
class Length:
    """A token-length distribution: fixed, uniform over [low, high], or a context fraction."""

    low: int = 0
    high: int = 0
    context_fraction: float | None = None

    @classmethod
    def parse(cls, spec: Any, what: str) -> Length:
        if not isinstance(spec, dict) or len(spec) != 1:
            raise ValueError(
                f"{what}: expected one of {{fixed|uniform|context_fraction}}: {spec!r}"
            )
        (kind, value), = spec.items()  # fmt: skip
        if kind == "fixed":
            return cls._checked(int(value), int(value), what)
        if kind == "uniform":
            if not isinstance(value, list) or len(value) != 2:
                raise ValueError(f"{what}: uniform takes [low, high], got {value!r}")
            return cls._checked(int(value[0]), int(value[1]), what)
        if kind == "context_fraction":
            if not 0.0 < float(value) < 1.0:
                raise ValueError(f"{what}: context_fraction must be in (0, 1), got {value!r}")
            return cls(context_fraction=float(value))
        raise ValueError(f"{what}: unknown length kind {kind!r} (fixed, uniform, context_fraction)")

    @classmethod
    def _checked(cls, low: int, high: int, what: str) -> Length:
        if low < 0 or high < low:
            raise ValueError(f"{what}: need 0 <= low <= high, got [{low}, {high}]")
        return cls(low, high)

    def resolve(self, context_len: int) -> Length:
        """This length with a context fraction turned into a fixed token count."""
        if self.context_fraction is None:
            return self
        n = max(1, math.floor(self.context_fraction * context_len))
        return Length(n, n)

    def draw(self, rng: random.Random) -> int:
        if self.context_fraction is not None:
            raise ValueError("resolve a context_fraction length against the context first")
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    @property
    def most(self) -> int:
        return self.high

    @property
    def mean(self) -> int:
        return (self.low + self.high) // 2


@dataclass(frozen=True)
class Requests:
    """How many requests one run sends: per_concurrency x concurrency, within [min, max]."""

    per_concurrency: int = 4
    min: int = 8
    max: int = 256

    def count(self, concurrency: int) -> int:
        return max(self.min, min(self.max, self.per_concurrency * concurrency))


@dataclass(frozen=True)
class Workload:
    name: str
    input_tokens: Length
    output_tokens: Length
    shared_prefix_tokens: int = 0
    source: str = "random"
    arrival: str = "concurrency"
    rate: float | None = None  # requests/s, poisson only
    requests: Requests = field(default_factory=Requests)
    description: str = ""

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVAL_MODES:
            raise ValueError(f"arrival.mode must be one of {ARRIVAL_MODES}, got {self.arrival!r}")
        if self.arrival == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError("arrival.mode poisson needs a positive arrival.rate (requests/s)")
        if self.source not in SOURCES:
            raise ValueError(f"prompt.source must be one of {SOURCES}, got {self.source!r}")
        if self.shared_prefix_tokens < 0:
            raise ValueError("prompt.shared_prefix_tokens must be >= 0")
        if self.output_tokens.context_fraction is None and self.output_tokens.low < 1:
            raise ValueError("output_tokens must be >= 1")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        prompt = data.get("prompt", {})
        arrival = data.get("arrival", {"mode": "concurrency"})
        requests = data.get("requests", {})
        return cls(
            name=str(data["name"]),
            description=str(data.get("description", "")),
            input_tokens=Length.parse(prompt.get("tokens"), "prompt.tokens"),
            shared_prefix_tokens=int(prompt.get("shared_prefix_tokens", 0)),
            source=str(prompt.get("source", "random")),
            output_tokens=Length.parse(data.get("output_tokens"), "output_tokens"),
            arrival=str(arrival.get("mode", "concurrency")),
            rate=float(arrival["rate"]) if arrival.get("rate") is not None else None,
            requests=Requests(**requests),
        )

    @classmethod
    def load(cls, name_or_path: str | Path) -> Workload:
        """A preset by name (bench/workloads/NAME.json) or any workload file."""
        path = Path(name_or_path)
        if not path.suffix:
            path = WORKLOAD_DIR / f"{name_or_path}.json"
        if not path.is_file():
            presets = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.json")))
            raise ValueError(f"no workload file {path} (presets: {presets})")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    def resolve(self, context_len: int) -> Workload:
        """Context fractions turned into token counts; prompt + output must fit the context."""
        inp, out = self.input_tokens.resolve(context_len), self.output_tokens.resolve(context_len)
        if self.input_tokens.context_fraction is not None:  # the fraction counts the prefix too
            n = max(1, inp.low - self.shared_prefix_tokens)
            inp = Length(n, n)
        longest = self.shared_prefix_tokens + inp.most + out.most
        if longest > context_len:
            raise ValueError(
                f"workload {self.name}: prompt + output up to {longest} tokens exceeds the "
                f"context of {context_len}"
            )
        return replace(self, input_tokens=inp, output_tokens=out)


def bundled_text_ids(tokenizer_json: Path) -> list[int]:
    """The bundled English text (engine.tiny_corpus), tokenized without special tokens."""
    from tokenizers import Tokenizer

    from engine.tiny_corpus import CORPUS

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return tokenizer.encode(CORPUS, add_special_tokens=False).ids


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt token ids, output length and send offset (s)."""

    index: int
    prompt: tuple[int, ...]
    output_tokens: int
    send_at_s: float = 0.0


@dataclass(frozen=True)
class Vocabulary:
    """Ids a random prompt may use: 0..size-1 less the special ones."""

    size: int
    special: frozenset[int] = frozenset()

    def draw(self, rng: random.Random, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            i = rng.randrange(self.size)
            if i not in self.special:
                ids.append(i)
        return ids


def build_requests(
    workload: Workload,
    count: int,
    vocab: Vocabulary,
    *,
    seed: int = 0,
    text_ids: Sequence[int] | None = None,
) -> list[RequestSpec]:
    """`count` requests of a resolved workload, deterministic in `seed`.

    Send offsets: 0 for `concurrency` and `burst` (the loader paces them), and
    cumulative exponential gaps of mean 1/rate for `poisson`. `text_ids` is the
    tokenized bundled text, needed when the source is `text`.
    """
    rng = random.Random(seed)
    if workload.source == "text" and not text_ids:
        raise ValueError("a text workload needs the tokenized text (text_ids)")
    text = list(text_ids or ())

    def draw_ids(n: int) -> list[int]:
        if workload.source == "random":
            return vocab.draw(rng, n)
        start = rng.randrange(max(1, len(text) - n))
        ids = text[start : start + n]
        while len(ids) < n:  # text shorter than n: wrap around
            ids.extend(text[: n - len(ids)])
        return ids

    prefix = draw_ids(workload.shared_prefix_tokens)
    specs, t = [], 0.0
    for i in range(count):
        prompt = prefix + draw_ids(max(1, workload.input_tokens.draw(rng)))
        if workload.arrival == "poisson" and i:
            t += rng.expovariate(workload.rate or 1.0)
        specs.append(RequestSpec(i, tuple(prompt), workload.output_tokens.draw(rng), t))
    return specs
