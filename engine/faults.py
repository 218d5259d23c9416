"""Test hook: make the engine core fail on purpose, to prove that a core failure fails every
open request, turns health off and ends the server with a non-zero code.

Owns the parsed form of `--fault-injection` ("core" or "core:after=N": the loop raises
after N steps) and the exception it raises.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a fault can be injected: the engine core's loop. The stage names of the engine
# this one replaced are still read, as the loop: they all meant "the engine dies".
PLACES = ("core", "prefill", "generate", "detokenize", "transfer")


class InjectedFault(RuntimeError):
    """Raised on purpose by --fault-injection."""


@dataclass(frozen=True)
class FaultPlan:
    """Parsed form of "place" or "place:after=N": fail after N steps."""

    place: str
    after: int = 0

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        place, _, option = spec.partition(":")
        if place not in PLACES:
            raise ValueError(f"fault_injection must name one of {PLACES}, got {place!r}")
        if not option:
            return cls(place)
        key, _, value = option.partition("=")
        if key != "after" or not value.isdigit():
            raise ValueError(f"fault_injection option must be 'after=N', got {option!r}")
        return cls(place, int(value))
