"""The engine-only limit on the tiny checkpoint: its rounds, its step time and the host's
CPU a step."""

from __future__ import annotations

from pathlib import Path

from bench.engine_limit import engine_tok_s


def test_engine_limit_reports_rounds_step_time_and_host_cpu(tiny_checkpoint: Path) -> None:
    result = engine_tok_s(
        str(tiny_checkpoint), slots=4, max_model_len=128, prompt_len=16, steps=8, rounds=2,
        dtype="float32",
    )  # fmt: skip
    assert len(result["tok_per_s_rounds"]) == 2  # the warming round is not reported
    assert result["tok_per_s"] > 0
    assert result["step_ms"] == 1e3 * 4 / result["tok_per_s"]
    assert result["host_cpu_ms_per_step"] > 0
