"""The prefix cache: prompt prefixes' KV kept on the device, block by block.

Runs on: the prefill thread only (the engine's prefill calls read and write
the pool), so nothing here locks. Owns: the pool's blocks, the hash chain of
every cached block, the pool block each one lives in, the LRU order, and the
hit counters.

A block is `block_size` prompt tokens; its key is a SHA-256 over the key of
the block before it and its own token ids, so a block is found only after the
same whole prefix (a crafted prompt cannot collide into another user's KV, as
Python's tuple hash would let it). A lookup refreshes the blocks it matched
from the last to the first, so the oldest block of a chain is always its
tail: eviction shortens chains from the end and never strands a tail behind
a lost head.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ModelConfig


@dataclass
class PrefixCacheStats:
    """Counters in prompt tokens, as vLLM's prefix_cache_queries / prefix_cache_hits count."""

    queries: int = 0
    hits: int = 0


class PrefixIndex:
    def __init__(self, blocks: int, block_size: int):
        if blocks < 1 or block_size < 1:
            raise ValueError(f"need blocks >= 1 and block_size >= 1, got {blocks}, {block_size}")
        self.blocks = blocks
        self.block_size = block_size
        self._where: OrderedDict[bytes, int] = OrderedDict()  # key -> pool block, oldest first
        self._free = list(range(blocks - 1, -1, -1))
        self.stats = PrefixCacheStats()

    @property
    def used(self) -> int:
        return len(self._where)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain keys of the prompt's whole blocks."""
        ids = np.asarray(token_ids, np.int64)
        keys, key = [], b""
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            key = hashlib.sha256(key + ids[start : start + self.block_size].tobytes()).digest()
            keys.append(key)
        return keys

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Pool blocks holding the longest cached run of the prompt's leading blocks.

        At least one prompt token is always left to compute (its logits give the
        first token), so a prompt of whole blocks never matches its last one.
        """
        keys = self.keys(token_ids[:-1])
        found: list[int] = []
        for key in keys:
            block = self._where.get(key)
            if block is None:
                break
            found.append(block)
        for key in reversed(keys[: len(found)]):
            self._where.move_to_end(key)
        self.stats.queries += len(token_ids)
        self.stats.hits += len(found) * self.block_size
        return found

    def peek(self, token_ids: Sequence[int]) -> int:
        """How many leading blocks `lookup` would find now; changes nothing, counts nothing."""
        found = 0
        for key in self.keys(token_ids[:-1]):
            if key not in self._where:
                break
            found += 1
        return found

    def plan_store(self, token_ids: Sequence[int], cached: int) -> list[tuple[int, int]]:
        """(block index in the prompt, pool block) for each whole block past the first
        `cached` that is not in the pool yet, evicting the least recently used; the
        caller copies those blocks' KV there."""
        keys = self.keys(token_ids)[: self.blocks]  # a longer chain could not be held whole
        for key in reversed(keys):  # this chain is the newest, head last: others go first
            if key in self._where:
                self._where.move_to_end(key)
        plan = []
        for index, key in enumerate(keys):
            if index < cached or key in self._where:
                continue
            if self._free:
                block = self._free.pop()
            else:
                _, block = self._where.popitem(last=False)
            self._where[key] = block
            plan.append((index, block))
        for key in reversed(keys):
            self._where.move_to_end(key)
        return plan


PREFIX_BLOCK = 16  # prompt tokens a block (vLLM's default block size)


def _load(
    k_pool: tuple[jax.Array, ...], v_pool: tuple[jax.Array, ...], ids: jax.Array
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A prompt buffer (prefill's layouts) whose leading positions are pool blocks `ids`.

    Positions past the hit hold whatever blocks the padding ids name; the
    pieces computed next overwrite them before any query can see them.
    """
    k = []
    for pool in k_pool:
        blocks = pool[ids]  # (S, kv, dim, B)
        kv, dim, size = blocks.shape[1], blocks.shape[2], blocks.shape[3]
        k.append(blocks.transpose(1, 2, 0, 3).reshape(kv, dim, ids.shape[0] * size))
    v = []
    for pool in v_pool:
        blocks = pool[ids]  # (S, kv, B, dim)
        kv, size, dim = blocks.shape[1], blocks.shape[2], blocks.shape[3]
        v.append(blocks.transpose(1, 0, 2, 3).reshape(kv, ids.shape[0] * size, dim))
    return tuple(k), tuple(v)


def _store(
    k_pool: tuple[jax.Array, ...],
    v_pool: tuple[jax.Array, ...],
    k_src: tuple[jax.Array, ...],
    v_src: tuple[jax.Array, ...],
    src: jax.Array,
    dst: jax.Array,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Copy blocks src[i] of a prompt's KV into pool blocks dst[i] (dst past the pool: none)."""
    size = k_pool[0].shape[-1]
    new_k, new_v = [], []
    for pool, keys in zip(k_pool, k_src, strict=True):
        kv, dim, t = keys.shape
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, -t % size)))
        blocks = keys.reshape(kv, dim, -1, size)[:, :, src].transpose(2, 0, 1, 3)
        new_k.append(pool.at[dst].set(blocks.astype(pool.dtype), mode="drop"))
    for pool, values in zip(v_pool, v_src, strict=True):
        kv, t, dim = values.shape
        values = jnp.pad(values, ((0, 0), (0, -t % size), (0, 0)))
        blocks = values.reshape(kv, -1, size, dim)[:, src].transpose(1, 0, 2, 3)
        new_v.append(pool.at[dst].set(blocks.astype(pool.dtype), mode="drop"))
    return tuple(new_k), tuple(new_v)


class PrefixPool:
    """The prefix cache's KV blocks on the device, and the index saying whose they are.

    Prefill-thread state: only the engine's prefill calls read or write it.
    """

    def __init__(
        self, cfg: ModelConfig, blocks: int, capacity: int, dtype: Any, sharding: Any
    ) -> None:
        if capacity % PREFIX_BLOCK:
            raise ValueError(f"a prompt buffer of {capacity} is not whole blocks")
        self.index = PrefixIndex(blocks, PREFIX_BLOCK)
        self.capacity = capacity
        layers = range(cfg.num_layers)
        kv, dim = cfg.num_kv_heads, cfg.head_dim
        zeros = jax.jit(
            lambda: (
                tuple(jnp.zeros((blocks, kv, dim, PREFIX_BLOCK), dtype) for _ in layers),
                tuple(jnp.zeros((blocks, kv, PREFIX_BLOCK, dim), dtype) for _ in layers),
            ),
            out_shardings=sharding,
        )
        self._k, self._v = zeros()
        per_block = 2 * cfg.num_layers * kv * dim * PREFIX_BLOCK * np.dtype(dtype).itemsize
        self.bytes = blocks * per_block
        self._load = jax.jit(_load)
        self._store = jax.jit(_store, donate_argnums=(0, 1))

    def load(self, blocks: Sequence[int]) -> tuple[int, Any]:
        """(cached positions, prompt buffers holding them) for a lookup's blocks."""
        ids = np.zeros((self.capacity // PREFIX_BLOCK,), np.int32)
        ids[: len(blocks)] = blocks
        return len(blocks) * PREFIX_BLOCK, self._load(self._k, self._v, ids)

    def store(self, token_ids: Sequence[int], cache: Any, cached: int) -> None:
        """Keep the prompt's whole blocks past the first `cached` (cache: a Prefix's)."""
        plan = self.index.plan_store(token_ids, cached)
        if not plan:
            return
        slots = self.capacity // PREFIX_BLOCK
        src = np.zeros((slots,), np.int32)
        dst = np.full((slots,), self.index.blocks, np.int32)
        for i, (index, block) in enumerate(plan):
            src[i], dst[i] = index, block
        k_src, v_src = cache
        self._k, self._v = self._store(self._k, self._v, k_src, v_src, src, dst)

    def warm(self, cache: Any) -> None:
        """Compile load, and store from a cache of this shape, changing no block."""
        slots = self.capacity // PREFIX_BLOCK
        src = np.zeros((slots,), np.int32)
        dst = np.full((slots,), self.index.blocks, np.int32)  # every write dropped
        k_src, v_src = cache
        self._k, self._v = self._store(self._k, self._v, k_src, v_src, src, dst)
        jax.block_until_ready(self._load(self._k, self._v, src))
