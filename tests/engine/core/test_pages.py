"""The page allocator: exact cases for each verb, then random verb sequences against a model.

Pages here are tiny (2 tokens) so a few tokens make whole chains; every case
names the pages it expects, since allocation order is part of the contract
(plain free pages in id order, then cached pages least recently freed first).
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core import pages as pages_module
from engine.core.pages import ROOT_KEY, PagePool, PageStats, block_key


def held(pool: PagePool, prompt: list[int]) -> list[int]:
    """A sequence's page table for `prompt`, its KV computed and registered."""
    table = pool.allocate(-(-len(prompt) // pool.page_size))
    assert table is not None
    pool.register(table, prompt)
    return table


def states(pool: PagePool) -> tuple[set[int], set[int], set[int]]:
    """(referenced, evictable, plain free) pages, read from the pool's own bookkeeping."""
    referenced = {p for p in range(pool.num_pages) if pool.refcount(p) > 0}
    return referenced, set(pool._evictable), set(pool._plain)


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 4), (4, -2)])
def test_bad_sizes_are_refused(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="num_pages >= 1 and page_size >= 1"):
        PagePool(num_pages, page_size)


def test_block_key_is_blake2b_over_parent_and_little_endian_int64() -> None:
    expected = hashlib.blake2b(b"\x01" * 16 + struct.pack("<2q", 7, -3), digest_size=16)
    assert block_key(b"\x01" * 16, [7, -3]) == expected.digest()
    assert block_key(ROOT_KEY, [1, 2]) != block_key(ROOT_KEY, [2, 1])


def test_allocate_hands_out_distinct_pages_once_referenced() -> None:
    pool = PagePool(4, 2)
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert pool.stats() == PageStats(total=4, free=1, cached=0)
    assert pool.stats().usage == 0.75
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)


def test_allocate_when_short_returns_none_and_changes_nothing() -> None:
    pool = PagePool(4, 2)
    table = held(pool, [1, 2, 3, 4])
    pool.free(table)  # two cached pages, two plain
    before = (pool.stats(), states(pool))
    assert pool.allocate(5) is None
    assert (pool.stats(), states(pool)) == before
    assert pool.match_prefix([1, 2, 3, 4, 5]) == table  # the cached blocks survived


def test_free_returns_pages_and_refuses_pages_nobody_holds() -> None:
    pool = PagePool(3, 2)
    a, b = pool.allocate(2) or []
    pool.free([a])
    assert pool.refcount(a) == 0 and pool.free_count() == 2
    with pytest.raises(ValueError, match="more often than they are held"):
        pool.free([a])
    with pytest.raises(ValueError, match="more often than they are held"):
        pool.free([b, b])  # b is held once: nothing may change
    assert pool.refcount(b) == 1
    with pytest.raises(ValueError, match="no such pages"):
        pool.free([-1])


def test_match_prefix_returns_registered_pages_and_references_them() -> None:
    pool = PagePool(8, 2)
    table = held(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([1, 2, 3, 4, 9, 9]) == table[:2]
    assert [pool.refcount(p) for p in table] == [2, 2, 1]
    assert pool.match_prefix([1, 2, 7, 7, 7]) == table[:1]
    assert pool.match_prefix([9, 2, 3, 4, 5]) == []


def test_a_block_matches_only_after_the_same_whole_prefix() -> None:
    pool = PagePool(8, 2)
    held(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([0, 0, 3, 4, 5]) == []  # block 1 alike, block 0 not


def test_match_leaves_at_least_one_token_to_compute() -> None:
    pool = PagePool(8, 2)
    table = held(pool, [1, 2, 3, 4, 5, 6])
    assert pool.match_prefix([1, 2, 3, 4]) == table[:1]
    assert pool.match_prefix([1, 2, 3, 4, 5]) == table[:2]
    assert pool.match_prefix([1, 2]) == []
    assert pool.match_prefix([1]) == []
    assert pool.match_prefix([]) == []


def test_partial_pages_register_once_full_and_register_is_idempotent() -> None:
    pool = PagePool(8, 2)
    table = pool.allocate(2) or []
    pool.register(table, [1, 2, 3])
    assert pool.match_prefix([1, 2, 3, 4, 0]) == table[:1]
    pool.free(table[:1])
    pool.register(table, [1, 2, 3, 4])
    pool.register(table, [1, 2, 3, 4])
    assert pool.match_prefix([1, 2, 3, 4, 0]) == table
    assert pool.stats() == PageStats(total=8, free=6, cached=0)


def test_register_hashes_only_pages_that_filled_since_the_last_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def counted(parent: bytes, tokens: list[int]) -> bytes:
        calls.append(1)
        return block_key(parent, tokens)

    monkeypatch.setattr(pages_module, "block_key", counted)
    pool = PagePool(64, 2)
    table = pool.allocate(50) or []
    tokens = list(range(100))
    for n in range(1, 101):
        pool.register(table, tokens[:n])
    assert len(calls) == 50


def test_register_refuses_short_tables_and_pages_nobody_holds() -> None:
    pool = PagePool(4, 2)
    table = pool.allocate(1) or []
    with pytest.raises(ValueError, match="cannot hold 3 tokens"):
        pool.register(table, [1, 2, 3])
    with pytest.raises(ValueError, match="not held"):
        pool.register([3], [1, 2])


def test_the_first_page_registered_for_a_block_keeps_it() -> None:
    pool = PagePool(8, 2)
    first = held(pool, [1, 2, 3])
    second = held(pool, [1, 2, 3])
    assert first != second
    assert pool.match_prefix([1, 2, 3]) == first[:1]
    pool.free(first[:1])
    pool.free(second)  # the copy is not registered: it turns plain free
    assert pool.stats() == PageStats(total=8, free=6, cached=0)
    assert pool.match_prefix([1, 2, 3]) == first[:1]


def test_a_copy_is_kept_when_the_first_holder_was_evicted_meanwhile() -> None:
    pool = PagePool(4, 2)
    first = held(pool, [1, 2, 3])  # pages 0, 1
    second = held(pool, [1, 2, 3])  # pages 2, 3: page 2 copies page 0
    pool.free(first)
    assert pool.stats().cached == 1
    assert pool.allocate(2) == [1, 0]  # page 1 was plain; page 0 is evicted
    pool.free(second)
    assert pool.stats() == PageStats(total=4, free=2, cached=1)
    assert pool.match_prefix([1, 2, 3]) == second[:1]


def test_eviction_takes_the_least_recently_freed_cached_pages_first() -> None:
    pool = PagePool(6, 2)
    a = held(pool, [1, 1, 1, 1])
    b = held(pool, [2, 2, 2, 2])
    c = held(pool, [3, 3, 3, 3])
    pool.free(b)
    pool.free(a)
    pool.free(c)
    assert pool.stats() == PageStats(total=6, free=6, cached=6)
    # Within one call a table is released tail first, so its tail goes before its head.
    assert pool.allocate(3) == [b[1], b[0], a[1]]
    assert pool.match_prefix([2, 2, 2, 2, 0]) == []
    assert pool.match_prefix([1, 1, 1, 1, 0]) == a[:1]
    assert pool.match_prefix([3, 3, 3, 3, 0]) == c


def test_plain_free_pages_go_before_cached_ones() -> None:
    pool = PagePool(4, 2)
    table = held(pool, [1, 2, 3, 4])
    pool.free(table)
    assert pool.allocate(2) == [2, 3]
    assert pool.match_prefix([1, 2, 3, 4, 5]) == table


def test_a_matched_cached_page_leaves_the_evictable_set() -> None:
    pool = PagePool(4, 2)
    table = held(pool, [1, 2, 3, 4])
    pool.free(table)
    assert pool.match_prefix([1, 2, 3]) == table[:1]
    assert pool.stats() == PageStats(total=4, free=3, cached=1)
    taken = pool.allocate(3) or []
    assert table[0] not in taken
    assert pool.allocate(1) is None
    assert pool.match_prefix([1, 2, 3]) == table[:1]  # still registered: it was in use


def test_fork_adds_a_reference_and_refuses_idle_pages() -> None:
    pool = PagePool(4, 2)
    table = held(pool, [1, 2, 3, 4])
    pool.fork(table)
    pool.free(table)
    assert [pool.refcount(p) for p in table] == [1, 1]
    assert pool.free_count() == 2
    pool.free(table)
    with pytest.raises(ValueError, match="no sequence holds"):
        pool.fork(table)
    assert [pool.refcount(p) for p in table] == [0, 0]


def test_without_prefix_caching_nothing_is_cached() -> None:
    pool = PagePool(4, 2, prefix_caching=False)
    table = held(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([1, 2, 3, 4, 5]) == []
    pool.free(table)
    assert pool.stats() == PageStats(total=4, free=4, cached=0)


PAGE = 2
TOKEN = st.integers(0, 1)  # two token ids: prompts share prefixes often


class Seq:
    """A model sequence: its page table and the tokens whose KV it has registered."""

    def __init__(self, pages: list[int], tokens: list[int]) -> None:
        self.pages = pages
        self.tokens = tokens


class PoolMachine(RuleBasedStateMachine):
    """The scheduler's verbs in random order against a model of references and contents.

    The model knows each page's references and the prefix each full page holds (set by
    register, forgotten when the page is handed out again); a match is right only if
    every page it returns holds exactly that prefix of the prompt.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(8, PAGE)
        self.refs = [0] * 8
        self.holds: dict[int, tuple[int, ...]] = {}  # page -> the prefix its block ends
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0

    def take(self, count: int) -> list[int] | None:
        got = self.pool.allocate(count)
        if got is None:
            assert count > self.refs.count(0)
            return None
        assert len(got) == len(set(got)) == count
        for page in got:
            assert self.refs[page] == 0, f"page {page} handed out while held"
            self.refs[page] = 1
            self.holds.pop(page, None)
        return got

    def release(self, pages: list[int]) -> None:
        self.pool.free(pages)
        for page in pages:
            self.refs[page] -= 1

    def match(self, prompt: list[int]) -> list[int]:
        found = self.pool.match_prefix(prompt)
        assert len(found) <= (len(prompt) - 1) // PAGE
        for index, page in enumerate(found):
            assert self.holds.get(page) == tuple(prompt[: (index + 1) * PAGE])
            self.refs[page] += 1
        return found

    def register(self, seq: Seq) -> None:
        self.pool.register(seq.pages, seq.tokens)
        for index in range(len(seq.tokens) // PAGE):
            prefix = tuple(seq.tokens[: (index + 1) * PAGE])
            assert self.holds.setdefault(seq.pages[index], prefix) == prefix

    @rule(prompt=st.lists(TOKEN, min_size=1, max_size=9))
    def admit(self, prompt: list[int]) -> None:
        found = self.match(prompt)
        new = self.take(-(-len(prompt) // PAGE) - len(found))
        if new is None:
            self.release(found)
            return
        seq = Seq(found + new, prompt)
        self.register(seq)
        self.seqs[self.next_id] = seq
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=TOKEN)
    def decode(self, data: st.DataObject, token: int) -> None:
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        if len(seq.tokens) == len(seq.pages) * PAGE:
            new = self.take(1)
            if new is None:
                return
            seq.pages += new
        seq.tokens.append(token)
        self.register(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        full = len(seq.tokens) // PAGE
        shared = seq.pages[:full]
        self.pool.fork(shared)
        for page in shared:
            self.refs[page] += 1
        self.seqs[self.next_id] = Seq(list(shared), seq.tokens[: full * PAGE])
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.release(seq.pages)

    @rule(prompt=st.lists(TOKEN, min_size=1, max_size=9))
    def probe(self, prompt: list[int]) -> None:
        self.release(self.match(prompt))

    @rule(page=st.integers(0, 7))
    def free_an_idle_page(self, page: int) -> None:
        if self.refs[page] == 0:
            before = (self.pool.stats(), states(self.pool))
            with pytest.raises(ValueError):
                self.pool.free([page])
            assert (self.pool.stats(), states(self.pool)) == before

    @invariant()
    def books_balance(self) -> None:
        referenced, evictable, plain = states(self.pool)
        assert [self.pool.refcount(p) for p in range(8)] == self.refs
        assert referenced | evictable | plain == set(range(8))
        assert len(referenced) + len(evictable) + len(plain) == 8
        assert len(self.pool._plain) == len(plain)  # no page twice in the plain queue
        assert self.pool.free_count() == len(plain) + len(evictable)
        for page in evictable:  # a cached page is one a match can find
            assert self.pool._page_of[self.pool._key_of[page]] == page
        assert self.pool.stats() == PageStats(8, len(plain) + len(evictable), len(evictable))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
