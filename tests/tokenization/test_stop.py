"""StopMatcher: stop strings found across deltas, nothing of a match ever leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import StopMatcher, StopResult

PROPERTY = settings(database=None, max_examples=300, deadline=None, derandomize=True)

ALPHABET = "ab😀日\u0301 "


def reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string completed first in `text` (longer wins at a tie)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s and s in text]
    if not found:
        return None
    end, _, stop = min(found)
    return end - len(stop), stop


def longest_held_tail(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max(
        (
            k
            for k in range(1, len(text) + 1)
            for s in stops
            if len(s) > k and s.startswith(text[-k:])
        ),
        default=0,
    )


@st.composite
def chunked_case(draw: st.DrawFn) -> tuple[list[str], list[str], bool]:
    text = draw(st.text(st.sampled_from(ALPHABET), max_size=30))
    stops = draw(st.lists(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=5), max_size=3))
    if text and draw(st.booleans()):  # often a stop string that really occurs
        i = draw(st.integers(0, len(text) - 1))
        stops.append(text[i : i + draw(st.integers(1, 5))])
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return chunks, stops, draw(st.booleans())


@PROPERTY
@given(case=chunked_case())
def test_matches_reference_whatever_the_chunking(case: tuple[list[str], list[str], bool]):
    chunks, stops, include = case
    text = "".join(chunks)
    matcher = StopMatcher(stops, include_stop_str_in_output=include)
    expected = reference(text, stops)
    longest = max((len(s) for s in stops), default=1)
    emitted, fed = "", ""
    for chunk in chunks:
        result = matcher.feed(chunk)
        emitted += result.text
        fed += chunk
        if result.matched is not None:
            break
        # Held back: exactly the longest tail that could still start a stop string.
        assert len(fed) - len(emitted) == longest_held_tail(fed, stops) <= longest - 1
        assert fed.startswith(emitted)
        if expected is not None:  # nothing from the start of the coming match leaks
            assert len(emitted) <= expected[0]
    tail = matcher.flush()
    if expected is None:
        assert matcher.matched is None and not matcher.done
        assert emitted + tail == text
    else:
        start, stop = expected
        assert matcher.matched == stop and matcher.done and tail == ""
        assert emitted == text[: start + len(stop) if include else start]


def test_stop_split_across_deltas():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello ST") == StopResult("Hello ")
    assert matcher.feed("O") == StopResult("")
    assert matcher.feed("P and more") == StopResult("", "STOP")
    assert matcher.done
    assert matcher.feed("ignored") == StopResult("", "STOP")
    assert matcher.flush() == ""


def test_diverging_prefix_is_released_unchanged():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a STO") == StopResult("a ")
    assert matcher.feed("NE") == StopResult("STONE")
    assert matcher.feed(" ST") == StopResult(" ")
    assert matcher.flush() == "ST"
    assert not matcher.done


def test_earliest_match_wins():
    matcher = StopMatcher(["world", "lo w", "xyz"])
    assert matcher.feed("hello world xyz") == StopResult("hel", "lo w")
    nested = StopMatcher(["abcde", "cd"])  # "cd" is complete before "abcde" could be
    assert nested.feed("abcdef") == StopResult("ab", "cd")
    same_end = StopMatcher(["de", "bcde"])
    assert same_end.feed("abcdef") == StopResult("a", "bcde")


def test_include_stop_str_in_output():
    matcher = StopMatcher(["</s>"], include_stop_str_in_output=True)
    assert matcher.feed("x</") == StopResult("x")
    assert matcher.feed("s>y") == StopResult("</s>", "</s>")


def test_no_stop_strings_pass_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc") == StopResult("abc")
    assert matcher.feed("") == StopResult("")
    assert matcher.flush() == ""
    assert StopMatcher(["", ""]).feed("abc") == StopResult("abc")


@pytest.mark.parametrize("stop", ["😀👍", "日本", "e\u0301!"])
def test_multi_codepoint_stops(stop: str):
    matcher = StopMatcher([stop])
    out = "".join(matcher.feed(c).text for c in f"xx{stop[:-1]}y{stop}zz")
    assert out == f"xx{stop[:-1]}y" and matcher.matched == stop
