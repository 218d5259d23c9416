"""Stop strings over a stream of text deltas, one instance per request.

Runs on: the output processor's receiver thread (frontend.output), after the incremental
detokenizer, inside a sample's TextStream.
Owns: the held-back tail of the request's text.

Only text that can no longer be part of a stop string is released: the longest
tail that is a proper prefix of some stop string is held back (at most the longest
stop length - 1 characters). A match is found wherever it falls across deltas; the
first stop string to be completed in the text wins (at the same end position, the
longer one, which starts earlier). The result does not depend on how the text is cut
into deltas. Nothing after a match is ever released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """Text safe to emit now; `matched` is the stop string once one is found."""

    text: str
    matched: str | None = None


class StopMatcher:
    """Consumes text deltas, releases only text no stop string can still claim."""

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._held = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        """True once a stop string has matched; later deltas are ignored."""
        return self.matched is not None

    def feed(self, delta: str) -> StopResult:
        """Add a delta; return the text that is now safe to emit, and the match if any."""
        if self.matched is not None:
            return StopResult("", self.matched)
        if not self._stops:
            return StopResult(delta)
        old_len = len(self._held)
        text = self._held + delta
        match = self._first_match(text, old_len)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self._include else start
            return StopResult(text[:end], stop)
        keep = self._hold_from(text)
        self._held = text[keep:]
        return StopResult(text[:keep])

    def flush(self) -> str:
        """At the end of the request: release the held-back text (none once matched)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_match(self, text: str, old_len: int) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first; only matches ending in new text exist."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = text.find(stop, max(0, old_len - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _hold_from(self, text: str) -> int:
        """Index of the longest tail of `text` that is a proper prefix of some stop string."""
        first = max(0, len(text) - self._max_hold)
        for index in range(first, len(text)):
            if text[index] in self._first_chars:
                tail = text[index:]
                if any(s.startswith(tail) for s in self._stops):
                    return index
        return len(text)
