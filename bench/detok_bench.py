"""Per-token cost of the text path (incremental detokenizer + stop matcher) along a sequence.

Feeds one long generated sequence (mixed English, CJK, emoji, accents) token by token
through `TextStream` with stop strings that never match (the worst case: every tail is
checked), and reports microseconds per token near the start and near the end. Flat
numbers mean the per-token cost does not grow with the sequence. A naive detokenizer
that decodes the whole sequence every token is shown for contrast.

    python bench/detok_bench.py [--tokenizer FOLDER] [--tokens 4000] [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tokenization import TextStream, Tokenizer  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. 日本語のテキストと中文文本。 "
    "Emoji: 👨‍👩‍👧‍👦 👍🏽 🏳️‍🌈, accents: café naïve résumé, RTL: שלום مرحبا. "
)
STOPS = ["<|im_end|>", "\n\nUser:", "STOP HERE"]


def sequence(tok: Tokenizer, n_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tok.encode(TEXT, add_special_tokens=False)
    return ids[:n_tokens]


def per_token_ns(step: Callable[[int], object], ids: list[int]) -> list[int]:
    clock = time.perf_counter_ns
    out: list[int] = []
    for token_id in ids:
        t0 = clock()
        step(token_id)
        out.append(clock() - t0)
    return out


def naive_step(tok: Tokenizer) -> Callable[[int], str]:
    """Decode everything so far each token: cost grows with the sequence."""
    ids: list[int] = []
    state = {"text": ""}

    def step(token_id: int) -> str:
        ids.append(token_id)
        text = tok.decode(ids)
        delta = text[len(state["text"]) :]
        state["text"] = text
        return delta

    return step


def measure(make_step: Callable[[], Callable[[int], object]], ids: list[int], runs: int):
    samples = [per_token_ns(make_step(), ids) for _ in range(runs)]
    by_position = [statistics.median(col) / 1000 for col in zip(*samples, strict=True)]
    return by_position


def window_us(by_position: list[float], center: int, half: int = 5) -> float:
    lo, hi = max(0, center - half), min(len(by_position), center + half)
    return statistics.mean(by_position[lo:hi])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "tests" / "fixtures" / "gpt2")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    tok = Tokenizer.from_folder(args.tokenizer)
    ids = sequence(tok, args.tokens + 10)
    prompt = tok.encode("Tell me a story.")
    rows = {
        "TextStream (detokenizer + stop)": lambda: TextStream.of(tok, prompt, stop=STOPS).add,
        "naive full decode (contrast)": lambda: naive_step(tok),
    }
    print(f"tokenizer={args.tokenizer.name} tokens={args.tokens} runs={args.runs} (median per pos)")
    print(f"{'':34s} {'us/token @10':>13s} {f'us/token @{args.tokens}':>15s} {'ratio':>6s}")
    for name, make in rows.items():
        by_position = measure(
            make, ids, args.runs if "naive" not in name else max(3, args.runs // 10)
        )
        start, end = window_us(by_position, 10), window_us(by_position, args.tokens)
        print(f"{name:34s} {start:13.2f} {end:15.2f} {end / start:6.2f}")


if __name__ == "__main__":
    main()
