"""engine.core.defaults: one table of per-backend defaults, and an engine core that
leaves page size, chunk and memory fraction unset gets its backend's."""

from __future__ import annotations

import pytest

from engine.attention import ReferenceAttention
from engine.core.core import CHUNK_SIZE, CoreConfig, backend_shapes
from engine.core.defaults import AWAITING_MEASUREMENT, BACKEND_DEFAULTS, defaults_for
from engine.core.scheduler import SchedulerConfig
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
    # whose chunks keep their alignment beside decode rows (its tiles' bits follow them)
    assert core.decode_chunk_size == core.chunk_size == 16


def test_beside_decode_rows_a_smaller_chunk_is_taken_where_the_backend_allows_it(
    tiny_checkpoint_of,
) -> None:  # type: ignore[no-untyped-def]
    """No backend takes a smaller chunk beside decode rows unless asked (measured on CPU:
    bench/README, "Smaller chunks beside decode rows"); asked, the CPU's attention kernel,
    which gives a query the same bits in any chunk, takes it (at most the chunk itself);
    a SchedulerConfig refuses one for a backend whose bits follow the chunks."""
    assert all(d.decode_chunk_size is None for d in BACKEND_DEFAULTS.values())
    folder = tiny_checkpoint_of("llama")
    unset = core_of(folder, num_pages=64, chunk_size=128, max_num_batched_tokens=None)
    assert unset.scheduler.config.any_form_hits
    assert unset.chunk_size == unset.decode_chunk_size == 128
    core = core_of(
        folder, num_pages=64, chunk_size=128, max_num_batched_tokens=None, decode_chunk_size=32
    )
    assert (core.chunk_size, core.decode_chunk_size) == (128, 32)
    assert core.scheduler.config.decode_chunk_size == 32
    given = core_of(folder, num_pages=64, chunk_size=128, decode_chunk_size=64)
    assert given.decode_chunk_size == given.chunk_size == 24  # at most 32 less 4 rows, in 8s
    with pytest.raises(ValueError, match="needs any_form_hits"):
        SchedulerConfig(4, 32, 128, 16, decode_chunk_size=8)
    with pytest.raises(ValueError, match="decode_chunk_size must be in"):
        SchedulerConfig(4, 32, 128, 16, decode_chunk_size=32, any_form_hits=True)
