"""The shapes the runner's programs take: (tokens, sequences) bucket pairs.

Owns: `Shapes`, published once per runner; a step pads its tokens and sequences to a
pair of its buckets, and warm-up compiles every pair. Pure host code (no jax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# XLA:CPU runs a one-row product (and a 16-bit two-row one) through other kernels than
# wider ones, which round the sums otherwise: every step's products take at least this
# many rows, so a sequence gets the same bits alone as in a full batch.
MIN_TOKENS_BUCKET = 8
MIN_SEQS_BUCKET = 4
# (tokens, sequences) of one sequence's program where every product keeps a row's bits
# at one row: two tokens, as at one token XLA:CPU copied the whole page cache four times
# a layer (its copy insertion; none at two)
SINGLE_ROW_BUCKET = (2, 1)


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest`, ending with `largest` itself."""
    out, size = [], smallest
    while size < largest:
        out.append(size)
        size *= 2
    return (*out, largest)


def fit(count: int, sizes: Sequence[int]) -> int:
    for size in sizes:
        if count <= size:
            return size
    raise ValueError(f"{count} exceeds the largest bucket {sizes[-1]}")


@dataclass(frozen=True)
class Shapes:
    """Every shape the runner's programs take, published once: steps pad to a (tokens,
    sequences) pair of these buckets.

    Decode steps (up to one token a sequence) pad to powers of two of tokens and of
    sequences, up to `decode_tokens`; a larger step (a prompt chunk in it) pads to a
    quarter of the token budget or to all of it, with every sequence row. Each program is
    an XLA compile of every layer (seconds each for a 30-layer model on a 2-core CPU,
    bench/README "Start-up"): a short prompt gets a small program, the rest share one."""

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    pages_per_seq: int
    decode_tokens: int  # the largest token bucket with a program per sequence bucket
    single_row: bool = False  # a SINGLE_ROW_BUCKET program: one sequence alone

    @classmethod
    def of(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pages_per_seq: int,
        single_row: bool = False,
    ) -> Shapes:
        """`single_row`: every product of the step gives a row the same bits at one row
        as at many (engine.paged_model.row_invariant_products), so one sequence alone gets
        a program of SINGLE_ROW_BUCKET, not the smallest buckets' padding (each padded row
        costs its products)."""
        seqs = buckets(min(MIN_SEQS_BUCKET, max_num_seqs), max_num_seqs)
        smallest = min(MIN_TOKENS_BUCKET, max_num_batched_tokens)
        decode = buckets(smallest, min(max(smallest, max_num_seqs), max_num_batched_tokens))
        quarter = -(-max_num_batched_tokens // 4 // smallest) * smallest
        larger = sorted({t for t in (quarter, max_num_batched_tokens) if t > decode[-1]})
        single = single_row and smallest > SINGLE_ROW_BUCKET[0]
        return cls((*decode, *larger), seqs, pages_per_seq, decode[-1], single)

    def seq_choices(self, tokens: int) -> list[int]:
        """The sequence buckets of token bucket `tokens`."""
        fits = [s for s in self.seq_buckets if s <= tokens]
        return fits if tokens <= self.decode_tokens else fits[-1:]

    def pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket pair a step may take."""
        first = [SINGLE_ROW_BUCKET] if self.single_row else []
        return first + [(t, s) for t in self.token_buckets for s in self.seq_choices(t)]

    def bucket(self, tokens: int, seqs: int) -> tuple[int, int]:
        if self.single_row and seqs <= 1 and tokens <= SINGLE_ROW_BUCKET[0]:
            return SINGLE_ROW_BUCKET
        t = fit(max(tokens, seqs), self.token_buckets)
        return t, fit(seqs, self.seq_choices(t))
