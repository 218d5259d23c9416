"""engine.core.memory: the KV cache's pages from a page count, a byte budget per device,
or what the devices have left; a budget that cannot hold one max_model_len sequence is
an error at start that names the sizes."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import Mesh

from engine.attention import KVLayout
from engine.core.memory import KVBudget, pages_for_budget
from tests.engine.conftest import core_of

PAGE = KVLayout(1, 8, kv_heads=2, head_dim=16)  # 8 x 2 x 2 x 16 x 4 = 2,048 bytes a layer


class FakeDevice:
    platform = "tpu"

    def __init__(self, limit: int, in_use: int) -> None:
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self) -> dict[str, int]:
        return self.stats


class FakeMesh:
    def __init__(self, *devices: object) -> None:
        self.devices = np.array(devices, dtype=object)


def pages(budget: KVBudget, mesh: object, layers: int = 2) -> int:
    return pages_for_budget(budget, PAGE, layers, mesh)  # type: ignore[arg-type]


def test_a_page_count_a_byte_budget_and_the_default() -> None:
    one = FakeMesh(object())
    assert pages(KVBudget(num_pages=7), one) == 7
    assert pages(KVBudget(kv_cache_memory_bytes=4096 * 10 + 5), one) == 10  # 2 layers a page
    two = FakeMesh(object(), object())  # kv heads split: half a page's bytes per device
    assert pages(KVBudget(kv_cache_memory_bytes=4096 * 10), two) == 20
    assert pages(KVBudget(default_pages=33), one) == 33  # devices that report no memory


def test_what_the_devices_have_left() -> None:
    gib = 1 << 30
    mesh = FakeMesh(FakeDevice(16 * gib, 2 * gib), FakeDevice(16 * gib, 3 * gib))
    got = pages(KVBudget(memory_utilization=0.5), mesh)
    usable = int(16 * gib * (0.5 - 0.05)) - 3 * gib  # the fuller device decides
    assert got == usable // (4096 // 2)
    with pytest.raises(ValueError, match="less than one page"):
        pages(KVBudget(kv_cache_memory_bytes=100), FakeMesh(object()))


def test_the_engine_core_takes_its_pages_from_the_budget(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama")
    page = 8 * 2 * 2 * 2 * 16 * 4  # positions x layers x (K, V) x kv heads x dims x bytes
    core = core_of(folder, kv_cache_memory_bytes=40 * page + 100)
    assert core.scheduler.pool.num_pages == 40
    assert core.kv_cache_bytes == 40 * page
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len 128"):
        core_of(folder, kv_cache_memory_bytes=10 * page)  # 16 pages needed
    cpu_default = core_of(folder)  # no memory statistics on XLA:CPU: every sequence whole
    assert cpu_default.scheduler.pool.num_pages == 4 * 128 // 8


def test_jax_cpu_devices_report_no_memory() -> None:
    import jax

    assert pages(KVBudget(default_pages=5), Mesh(np.array(jax.devices()[:1]), ("model",))) == 5
