"""The page allocator of the paged KV cache, with the prefix cache's index over it.

Runs on: the engine core's scheduler loop only (one thread, so nothing here
locks). Owns: every page's reference count, the plain free pages, the cached
pages no sequence uses (evictable, least recently freed first), and the block
key of each page whose KV is a full, known block. Receives: the scheduler's
verbs `match_prefix`, `allocate`, `register`, `fork` and `free` on page ids.
Emits: page ids and `PageStats`; it never touches the device.

A page holds `page_size` positions of one sequence's KV; the `page_size` token
ids it holds are its block. A block's key is a digest of the key of the block
before it and its own ids, so a key names a whole prefix from position 0 and a
hit maps pages by reference, copying nothing (vLLM v1's block pool scheme).

Every page is in exactly one state: referenced (refcount > 0), evictable
(refcount 0, its key registered, kept for later hits) or plain free (refcount
0, nothing known about its contents). `allocate` takes plain free pages first,
then evicts cached pages oldest first.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_KEY = b""  # the parent key of a prompt's first block


def root_key(adapter: int) -> bytes:
    """The parent key of the first block of a sequence with LoRA adapter `adapter` (its
    id, engine.lora.Adapters; 0: none): a cached block is never shared across adapters."""
    return ROOT_KEY if adapter == 0 else b"lora:%d" % adapter


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain key of a block: blake2b-128 over the parent key and the ids as little-endian
    int64, the same in every process and on every host."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(parent + ids.tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PageStats:
    """Pages in all, pages `allocate` could hand out, and the cached ones among those."""

    total: int
    free: int  # plain free + evictable cached
    cached: int  # registered blocks no sequence uses: evictable, counted in `free` too

    @property
    def usage(self) -> float:
        """The fraction of pages some sequence holds (vLLM's KV-cache usage)."""
        return (self.total - self.free) / self.total


class PagePool:
    """Reference-counted pages of the KV cache and the index of cached blocks in them."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_pages
        self._plain: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        # The key of each page whose block is full and known, registered or not. Set only by
        # `register`, dropped when the page turns plain free or is evicted; within a live page
        # table the pages that have one are always a prefix of it.
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}  # registered key -> its page (the first one wins)

    def stats(self) -> PageStats:
        return PageStats(self.num_pages, self.free_count(), len(self._evictable))

    def free_count(self) -> int:
        """How many pages `allocate` could hand out now."""
        return len(self._plain) + len(self._evictable)

    def refcount(self, page: int) -> int:
        """How many sequences hold `page`."""
        return self._refs[page]

    def match_prefix(self, tokens: Sequence[int], root: bytes = ROOT_KEY) -> list[int]:
        """The pages of the longest run of the prompt's leading blocks that are cached, each
        now referenced once more (`root`: the chain's first parent key, root_key's).

        A prompt of whole pages never matches its last one: at least one token is
        computed, because the step needs its logits.
        """
        if not self.prefix_caching:
            return []
        size = self.page_size
        found: list[int] = []
        key = root
        for start in range(0, (len(tokens) - 1) // size * size, size):
            key = block_key(key, tokens[start : start + size])
            page = self._page_of.get(key)
            if page is None:
                break
            found.append(page)
        for page in found:
            self._hold(page)
        return found

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, each referenced once, or None (and nothing changes) when fewer
        than `count` are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > self.free_count():
            return None
        pages = []
        for _ in range(count):
            if self._plain:
                page = self._plain.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def register(
        self,
        pages: Sequence[int],
        tokens: Sequence[int],
        length: int | None = None,
        root: bytes = ROOT_KEY,
    ) -> None:
        """Record that the sequence whose page table is `pages` holds the KV of the first
        `length` (default all) of `tokens` (positions 0 on): each full page gets its block
        key, registered unless another page already holds that block.

        Idempotent, and it hashes only pages that filled since the last call.
        """
        length = len(tokens) if length is None else length
        if len(pages) * self.page_size < length or length > len(tokens):
            raise ValueError(f"{len(pages)} pages of {self.page_size} cannot hold {length} tokens")
        if not self.prefix_caching:
            return
        full = length // self.page_size
        known = full
        while known > 0 and pages[known - 1] not in self._key_of:
            known -= 1
        key = self._key_of[pages[known - 1]] if known else root
        for index in range(known, full):
            page = pages[index]
            if not 0 <= page < self.num_pages or self._refs[page] == 0:
                raise ValueError(f"page {page} is not held by any sequence")
            start = index * self.page_size
            key = block_key(key, tokens[start : start + self.page_size])
            self._key_of[page] = key
            self._page_of.setdefault(key, page)

    def fork(self, pages: Sequence[int]) -> None:
        """One more reference on each page: another sequence shares their blocks."""
        self._check_ids(pages)
        idle = [page for page in pages if self._refs[page] == 0]
        if idle:
            raise ValueError(f"cannot fork pages no sequence holds: {idle}")
        for page in pages:
            self._refs[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; a page no one holds stays cached if its block
        is registered, else turns plain free.

        Pages are released last to first, so a sequence's tail blocks are evicted before
        its head (a lost head would strand every block after it).
        """
        self._check_ids(pages)
        short = [page for page, n in Counter(pages).items() if self._refs[page] < n]
        if short:
            raise ValueError(f"freeing pages more often than they are held: {short}")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._release(page)

    def _check_ids(self, pages: Sequence[int]) -> None:
        bad = [page for page in pages if not 0 <= page < self.num_pages]
        if bad:
            raise ValueError(f"no such pages: {bad} (the pool has {self.num_pages})")

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1

    def _release(self, page: int) -> None:
        key = self._key_of.get(page)
        if key is not None and self._page_of.setdefault(key, page) == page:
            # Registered, or a copy whose first holder has since been evicted: keep it.
            self._evictable[page] = None
            return
        self._key_of.pop(page, None)
        self._plain.append(page)
