"""Engine-only prompt time on the tiny checkpoint: one figure per shape, its repeats, and
the shapes' parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.prompt_steps import parse_shapes, prompt_ms


def test_prompt_ms_reports_each_shape_and_its_repeats(tiny_checkpoint: Path) -> None:
    result = prompt_ms(str(tiny_checkpoint), [(1, 20), (3, 9)], 2, max_model_len=64, chunk=16)
    assert list(result["ms"]) == ["1x20", "3x9"]
    assert [len(runs) for runs in result["ms_runs"].values()] == [2, 2]  # the warming run left out
    assert all(ms > 0 for ms in result["ms"].values())


def test_shapes_are_count_x_length() -> None:
    assert parse_shapes("1x128, 8x64") == [(1, 128), (8, 64)]
    for bad in ("128", "0x5", "ax5", "2x"):
        with pytest.raises(ValueError):
            parse_shapes(bad)
