"""bench.gpu_check, the one GPU script: its parts run on the CPU here (the full `--smoke`
run takes minutes on this machine's two cores: the Pallas interpreter compiles slowly),
a part past the budget is listed as skipped, and the kernel check compares on whatever
backend jax has."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gpu_check


def test_parts_past_the_budget_are_skipped_and_written(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    rows = gpu_check.main(["--smoke", "--budget-s", "0", "--json", str(out)])
    assert rows[0]["kind"] == "setup" and rows[0]["platform"] == "cpu"
    titles = [title for title, _ in gpu_check.parts(smoke=True)]
    assert [r["part"] for r in rows[1:]] == titles
    assert {r["kind"] for r in rows[1:]} == {"skipped"}
    assert json.loads(out.read_text()) == rows
    full = [title for title, _ in gpu_check.parts(smoke=False)]
    assert full[:6] == [
        "kernel 8b bfloat16", "kernel 8b float32", "kernel 1b bfloat16", "kernel 1b float32",
        "attention page 16", "attention page 128",
    ]  # fmt: skip
    assert {
        "8b decode 1",
        "8b decode 64",
        "1b decode 1",
        "1b decode 256",
        "8b prefill 8192",
    } <= set(full)


def test_kernel_check_compares_both_forms() -> None:
    rows = gpu_check.kernel_check("tiny", "float32", smoke=True)
    assert [r["attention"] for r in rows] == ["gpu-pallas", "gpu-xla"]
    for row in rows:
        assert row["ok"] and row["max_abs_error"] <= row["tolerance"] == 1e-4
