"""engine.core.defaults: one table of per-backend defaults, and an engine core that
leaves page size, chunk and memory fraction unset gets its backend's."""

from __future__ import annotations

import pytest

from engine.attention import ReferenceAttention
from engine.core.core import CHUNK_SIZE, CoreConfig, backend_shapes
from engine.core.defaults import AWAITING_MEASUREMENT, BACKEND_DEFAULTS, defaults_for
from tests.engine.conftest import core_of


def test_every_backend_has_its_row_and_gpu_awaits_measurement() -> None:
    assert set(BACKEND_DEFAULTS) == {"cpu", "tpu", "gpu"}
    assert defaults_for("gpu").source == AWAITING_MEASUREMENT
    assert "measurement" not in defaults_for("tpu").source
    assert defaults_for("rocm") == BACKEND_DEFAULTS["cpu"]  # unknown: the CPU's
    assert CHUNK_SIZE == {"cpu": 128, "tpu": 1024, "gpu": 256}  # read from the table
    unset = CoreConfig("m", max_num_seqs=8, chunk_size=None, max_num_batched_tokens=None)
    assert backend_shapes(unset, "gpu") == (defaults_for("gpu").chunk_size, 256 + 8)


def test_an_unset_config_takes_the_backends_values(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    core = core_of(
        tiny_checkpoint_of("llama"), page_size=None, memory_utilization=None, num_pages=64,
        attention="reference",
    )  # fmt: skip
    cpu = defaults_for("cpu")
    assert core.page_size == cpu.page_size == core.config.page_size
    assert core.config.memory_utilization == cpu.memory_utilization
    assert core.runner.layout.page_size == cpu.page_size and not core.runner.layout.head_major
    # "reference" chooses the definition over the CPU's own backend
    assert isinstance(core.attention, ReferenceAttention)


def test_a_gpu_backend_is_refused_elsewhere(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="GPU only"):
        core_of(tiny_checkpoint_of("llama"), num_pages=64, attention="gpu-pallas")
    with pytest.raises(ValueError, match="attention must be one of"):
        CoreConfig("m", attention="flash")
