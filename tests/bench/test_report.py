"""Ratios and the report of a serving run, on made-up results with hand-checked numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.report import markdown, write_report
from bench.run_serving import ratios


def level(concurrency: int, tok_s: float, ttft: float, itl: float) -> dict:
    dist = lambda v: {"mean": v, "p50": v, "p90": v, "p99": v, "max": v}  # noqa: E731
    return {
        "concurrency": concurrency, "requests": 8, "completed": 8, "failed": 0,
        "request_per_s": 1.0, "output_tok_per_s": tok_s, "total_tok_per_s": 2 * tok_s,
        "ttft_ms": dist(ttft), "itl_ms": dist(itl), "tpot_ms": dist(itl), "e2e_ms": dist(9.0),
    }  # fmt: skip


def run(name: str, levels: list[dict], occupancy: float) -> dict:
    return {
        "server": name, "command": "python -m server", "startup_s": 1.0, "warmup_failed": 0,
        "sweep": levels, "full_occupancy": {"requests": 4, "output_tok_per_s": occupancy},
    }  # fmt: skip


def results() -> dict:
    engine = {"before": {"tok_per_s": 900.0}, "after": {"tok_per_s": 1000.0}}
    servers = [
        run("ours", [level(1, 100.0, 10.0, 5.0), level(4, 800.0, 20.0, 8.0)], 950.0),
        run("peer", [level(1, 50.0, 20.0, 10.0), level(4, 400.0, 10.0, 4.0)], 500.0),
        {"server": "absent", "skipped": "not installed"},
    ]
    return {
        "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 1.0, "python": "3", "jax": "0",
                    "date": "today"},
        "model": "m", "workload": "random", "max_slots": 4, "context": 64, "dtype": "float32",
        "workload_resolved": {"input_tokens": [8, 8], "shared_prefix_tokens": 0,
                              "output_tokens": [8, 8], "arrival": "concurrency"},
        "engine_only": engine, "servers": servers, "ratios": ratios(engine, servers),
    }  # fmt: skip


def test_ratios_use_the_faster_engine_figure_and_match_levels() -> None:
    r = results()["ratios"]
    assert r["engine_only_tok_per_s"] == 1000.0
    assert r["ours"]["full_occupancy_over_engine"] == pytest.approx(0.95)
    assert r["ours"]["sweep_at_max_slots_over_engine"] == pytest.approx(0.8)
    assert r["ours_over_peer"]["1"] == {"output_tok_per_s": 2.0, "ttft_p50": 0.5, "itl_p50": 0.5}
    assert r["ours_over_peer"]["4"] == {"output_tok_per_s": 2.0, "ttft_p50": 2.0, "itl_p50": 2.0}
    assert "ours_over_absent" not in r


def test_markdown_has_every_server_and_ratio() -> None:
    text = markdown(results())
    assert "| ours | 950.0 | 0.950 | - | 0.800 |" in text  # no rounds: nothing paired
    assert "Skipped: not installed" in text
    assert "| 4 | 2.000 | 2.000 | 2.000 |" in text


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the `bench` extra
    paths = write_report(results(), tmp_path)
    assert sorted(p.name for p in paths) == [
        "latency_vs_concurrency.png", "results.md", "throughput_vs_concurrency.png",
    ]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in paths)
