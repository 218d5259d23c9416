"""The copy-heavy workload of bench.speculative: where a token stream starts repeating
itself, as the n-gram lookup sees it."""

from __future__ import annotations

from bench.speculative import loop_start, predicted


def test_a_stream_that_falls_into_a_loop_is_cut_where_the_loop_starts() -> None:
    noise = list(range(100, 164))  # no token repeats: nothing is predictable
    loop = [7, 8, 9] * 30
    tokens = noise + loop
    assert predicted(tokens, 10, 40) == 0.0
    # the loop's first period is new, and so is its 4th token (its tail "7 8 9" has not
    # occurred before); from the 5th on, each is predicted
    assert predicted(tokens, 64 + 3, 60) < 1.0
    assert predicted(tokens, 64 + 4, 60) == 1.0
    cut = loop_start(tokens, 8, 40, 0.9)
    assert cut is not None and 64 - 8 <= cut <= 64
    assert predicted(tokens, cut, 40) >= 0.9


def test_a_stream_that_never_loops_has_no_cut() -> None:
    assert loop_start(list(range(300)), 0, 64, 0.5) is None
