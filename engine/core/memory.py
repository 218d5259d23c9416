"""How many KV pages the engine core gets.

Owns: the cache's size (the one owner of it). Receives the config's wish (a page count,
a byte budget per device, or a fraction of each device's memory) and the layout of one
page; emits a page count. Pure arithmetic but for reading the devices' memory
statistics (accelerators report them; XLA's CPU backend does not, so there the default
is every sequence a whole context, the slot cache's bytes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from engine.attention import KVLayout

logger = logging.getLogger(__name__)

# Device memory a step's temporaries may take beyond params and pages, when sizing the
# cache from what the devices have left (activations, logits, sampling's passes).
TEMPORARY_HEADROOM = 0.05


@dataclass(frozen=True)
class KVBudget:
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None  # per device (vLLM's meaning)
    memory_utilization: float = 0.9  # of each device's memory (vLLM's gpu_memory_utilization)
    default_pages: int = 0  # when the devices report no memory


def pages_for_budget(budget: KVBudget, page: KVLayout, num_layers: int, mesh: Mesh) -> int:
    """Pages of `page`'s layout (one position block of every layer) the budget buys."""
    shards = mesh.devices.size
    per_device = page.page_bytes * num_layers // shards  # kv heads are split over the mesh
    if budget.num_pages is not None:
        return budget.num_pages
    if budget.kv_cache_memory_bytes is not None:
        pages = budget.kv_cache_memory_bytes // per_device
        if pages < 1:
            raise ValueError(
                f"kv_cache_memory_bytes {budget.kv_cache_memory_bytes} is less than one page "
                f"of {page.page_size} positions ({per_device} bytes per device)"
            )
        return pages
    free = _free_bytes(mesh, budget.memory_utilization)
    if free is None:
        return budget.default_pages
    pages = free // per_device
    logger.info("KV cache: %d bytes per device left for pages: %d pages", free, pages)
    return pages


def _local(mesh: Mesh) -> list[Any]:
    """The mesh's devices this process owns (multi-host: another's report no memory here)."""
    local = getattr(mesh, "local_devices", None)
    return list(local) if local is not None else list(mesh.devices.flat)


def _free_bytes(mesh: Mesh, utilization: float) -> int | None:
    """The least, over the mesh's devices, of utilization x memory less what is in use now
    (params placed) and a headroom for temporaries; None where devices report nothing."""
    free = []
    for device in _local(mesh):
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        usable = int(limit * (utilization - TEMPORARY_HEADROOM))
        free.append(max(0, usable - int(stats.get("bytes_in_use", 0))))
    return min(free)
