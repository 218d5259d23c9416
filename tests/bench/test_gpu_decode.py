"""bench.gpu_decode runs end to end on whatever backend jax has (the CPU here): the
script a lent GPU runs once must not rot between loans."""

from __future__ import annotations

from bench import gpu_decode


def test_decode_figures_for_one_config() -> None:
    (result,) = gpu_decode.main(
        ["--configs", "1b", "--layers", "1", "--batches", "2", "--context", "16", "--steps", "2"]
    )
    assert result["batch"] == 2 and result["layers"] == 1
    assert result["step_ms"] > 0 and result["tokens_per_s"] > 0
    # every weight once (the tied head is the embedding) plus the live K/V
    assert result["bytes_per_step"] > 128256 * 2048 * 2
    assert 0 < result["bandwidth_utilization"] < 1
