"""engine.heap: startup garbage is collected, what is live is frozen out of later collections."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from engine.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # this test process's later collections walk everything again


def test_garbage_goes_and_the_live_heap_is_frozen(unfrozen_after: None) -> None:
    garbage, live = Node(), Node()
    garbage.other, live.other = Node(), Node()
    assert garbage.other is not None and live.other is not None
    garbage.other.other, live.other.other = garbage, live  # two cycles
    gone = weakref.ref(garbage)
    del garbage
    frozen = freeze_startup_heap()
    assert gone() is None  # the unreachable cycle was collected first, not frozen
    # at least what it froze: a thread an earlier test left may freeze more meanwhile
    assert 0 < frozen <= gc.get_freeze_count()
    assert gc.is_tracked(live) and not any(live is o for o in gc.get_objects())  # frozen
