"""bench.lora_serving, a smoke run on the tiny checkpoint (no figure is judged: the
benchmark is for a quiet machine): adapters it writes are ones the server loads, every
request of both runs succeeds, and the report holds each round's rates, their ratio and
the run-time load times."""

from __future__ import annotations

from pathlib import Path

from bench import lora_serving
from engine.config import load_model_config
from engine.lora import read_adapter


def test_a_smoke_run_reports_both_rates_and_load_times(tiny_checkpoint: Path, tmp_path: Path):
    folder = lora_serving.write_adapter(tiny_checkpoint, tmp_path / "one", rank=4, seed=0)
    read_adapter(folder, load_model_config(tiny_checkpoint), 4, "float32")  # the engine's check
    report = lora_serving.main(
        ["--model", str(tiny_checkpoint), "--adapters", "2", "--rank", "4", "--concurrency", "4",
         "--requests", "8", "--prompt-tokens", "8", "--output-tokens", "8", "--context", "64",
         "--rounds", "1", "--loads", "2", "--adapter-dir", str(tmp_path / "adapters")]
    )  # fmt: skip
    assert len(report["rounds"]) == 1
    for r in report["rounds"]:
        assert r["base"]["failed"] == 0 and r["lora"]["failed"] == 0
        assert r["base"]["models"] == ["base"] and r["lora"]["models"] == ["lora0", "lora1"]
        assert r["plain"]["failed"] == 0 and r["plain"]["models"] == ["base"]
        assert r["lora_over_base"] > 0 and r["lora_over_plain"] > 0
    assert report["lora_over_plain_median"] > 0
    assert len(report["load_s"]) == 2 and report["load_s_median"] > 0
    assert "adapter_dir" in report["setup"] and report["setup"]["adapter_dir"] is None
