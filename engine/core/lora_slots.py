"""Which LoRA adapter each slot of the device pool holds, and who uses it.

Runs on: the scheduler loop only (one thread, nothing locks). Owns: the slot of each
resident adapter, each slot's count of running sequences, the idle slots in least
recently used order, and the slot writes the next step must make first. Receives the
scheduler's `acquire` (a sequence admitted) and `release` (its row freed); emits slot
numbers and `(slot, adapter)` writes for engine.core.core to do before the step runs.

A slot in use is never taken: an adapter that is not resident waits until some slot is
idle (no running sequence uses it), then takes the least recently used one (vLLM's LRU
policy). Adapter 0 is the base model: no slot (engine.lora.NO_ADAPTER).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.core.sequence import SequenceState
from engine.lora import NO_ADAPTER


class LoraSlots:
    def __init__(self, count: int) -> None:
        """`count`: the pool's slots (0: no adapters, every sequence the base model's)."""
        self.count = count
        self._slot_of: dict[int, int] = {}  # resident adapter -> its slot
        self._adapter_in: dict[int, int] = {}  # slot -> the adapter it holds
        self._users = [0] * count  # running sequences per slot
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(count))
        self._writes: list[tuple[int, int]] = []

    def available(self, adapter: int) -> bool:
        """`acquire` would give this adapter a slot now."""
        return adapter == 0 or adapter in self._slot_of or bool(self._idle)

    def first(self, waiting: Iterable[SequenceState]) -> SequenceState | None:
        """The first of the waiting sequences whose adapter can have a slot now."""
        return next((seq for seq in waiting if self.available(seq.adapter)), None)

    def acquire(self, adapter: int) -> int:
        """A running sequence's slot for `adapter` (loading it into the least recently
        used idle slot if it is not resident); call only when `available`."""
        if adapter == 0:
            return NO_ADAPTER
        slot = self._slot_of.get(adapter)
        if slot is None:
            slot, _ = self._idle.popitem(last=False)
            old = self._adapter_in.pop(slot, None)
            if old is not None:
                del self._slot_of[old]
            self._slot_of[adapter] = slot
            self._adapter_in[slot] = adapter
            self._writes.append((slot, adapter))
        self._idle.pop(slot, None)
        self._users[slot] += 1
        return slot

    def release(self, adapter: int) -> None:
        """A sequence of `adapter` no longer runs (finished, preempted, handed off)."""
        if adapter == 0:
            return
        slot = self._slot_of[adapter]
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None  # most recently used: taken last

    def slot(self, adapter: int) -> int:
        return NO_ADAPTER if adapter == 0 else self._slot_of[adapter]

    def take_writes(self) -> tuple[tuple[int, int], ...]:
        """The (slot, adapter) loads made since the last call, oldest first."""
        out, self._writes = tuple(self._writes), []
        return out

    def running(self) -> list[int]:
        """Adapters some running sequence uses."""
        return sorted(a for a, s in self._slot_of.items() if self._users[s] > 0)
