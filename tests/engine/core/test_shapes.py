"""engine.core.shapes: the buckets a step pads to, with and without the one-row program
(a sequence decoding alone, where every product keeps a row's bits at one row)."""

from __future__ import annotations

from engine.core.shapes import MIN_SEQS_BUCKET, MIN_TOKENS_BUCKET, SINGLE_ROW_BUCKET, Shapes


def test_without_the_one_row_program_the_smallest_buckets_pad() -> None:
    shapes = Shapes.of(32, 288, 32)
    assert shapes.token_buckets[0] == MIN_TOKENS_BUCKET
    assert shapes.bucket(1, 1) == (MIN_TOKENS_BUCKET, MIN_SEQS_BUCKET)
    assert SINGLE_ROW_BUCKET not in shapes.pairs()


def test_the_one_row_program_serves_one_sequence_decoding_alone_only() -> None:
    plain, single = Shapes.of(32, 288, 32), Shapes.of(32, 288, 32, single_row=True)
    assert single.pairs() == [SINGLE_ROW_BUCKET, *plain.pairs()]  # one program more
    assert single.bucket(1, 1) == single.bucket(2, 1) == SINGLE_ROW_BUCKET
    # two tokens, or two sequences, take the buckets they took before
    for tokens, seqs in ((3, 1), (2, 2), (8, 3), (40, 1), (288, 32)):
        assert single.bucket(tokens, seqs) == plain.bucket(tokens, seqs), (tokens, seqs)
