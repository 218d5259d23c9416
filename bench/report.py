"""results.md (and the plots, when matplotlib is installed) from a serving run's results.

Run: `python -m bench.report RESULTS_DIR` rewrites RESULTS_DIR/results.md and the PNGs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], path: Path | None) -> None:
    """A benchmark's JSON report: printed, and written to `path` (its --json) if given."""
    text = json.dumps(report, indent=1)
    print(text)
    if path is not None:
        path.write_text(text)


def _f(value: Any, digits: int = 1) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    m, r = results["machine"], results["ratios"]
    w = results["workload_resolved"]
    eng = results["engine_only"]
    lines = [
        f"# Serving benchmark: {results['model']}, {results['workload']} workload",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python {m['python']}, "
        f"JAX {m['jax']}; {m['date']}.",
        f"Workload: prompt {w['shared_prefix_tokens']} shared + {w['input_tokens']} tokens, "
        f"output {w['output_tokens']} tokens (ignore_eos), arrival {w['arrival']}; "
        f"{results['max_slots']} slots, context {results['context']}, {results['dtype']}.",
        "",
        f"Engine-only limit ({results['max_slots']} slots busy, no server): "
        f"{_f(eng['before']['tok_per_s'])} tok/s before the servers, "
        f"{_f(eng['after']['tok_per_s'])} after; the larger is the limit below. With "
        "alternating rounds the engine also runs after each server's round; paired is the "
        "median of each round's full occupancy over that run.",
        "",
        "| server | full occupancy tok/s | / engine-only | paired by round | "
        "tok/s at c=slots / engine-only |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in results["servers"]:
        if "sweep" not in run:
            continue
        ratio = r[run["server"]]
        lines.append(
            f"| {run['server']} | {_f(run['full_occupancy']['output_tok_per_s'])} | "
            f"{_f(ratio['full_occupancy_over_engine'], 3)} | "
            f"{_f(ratio.get('full_occupancy_over_engine_paired'), 3)} | "
            f"{_f(ratio['sweep_at_max_slots_over_engine'], 3)} |"
        )
    for run in results["servers"]:
        lines += ["", f"## {run['server']}", ""]
        if "sweep" not in run:
            lines.append(f"Skipped: {run['skipped']}")
            continue
        lines += [
            f"`{run['command']}` (ready after {_f(run['startup_s'])} s)",
            "",
            "| concurrency | requests | failed | req/s | output tok/s | total tok/s | "
            "TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | TPOT p50 ms | E2E p50 ms |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for lv in run["sweep"]:
            t, i = lv["ttft_ms"], lv["itl_ms"]
            lines.append(
                f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | "
                f"{_f(lv['request_per_s'], 2)} | {_f(lv['output_tok_per_s'])} | "
                f"{_f(lv['total_tok_per_s'])} | {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | "
                f"{_f(i['p50'], 2)} / {_f(i['p90'], 2)} / {_f(i['p99'], 2)} | "
                f"{_f(lv['tpot_ms']['p50'], 2)} | {_f(lv['e2e_ms']['p50'])} |"
            )
    for key, per_level in r.items():
        if not key.startswith("ours_over_"):
            continue
        paired = any("paired" in v for v in per_level.values())
        lines += [
            "",
            f"## ours / {key.removeprefix('ours_over_')}, per concurrency",
            "",
            "| concurrency | output tok/s | TTFT p50 | ITL p50 |"
            + (" paired: output tok/s | TTFT p50 | ITL p50 | rounds |" if paired else ""),
            "| --- | --- | --- | --- |" + (" --- | --- | --- | --- |" if paired else ""),
        ]
        for level, v in per_level.items():
            row = (
                f"| {level} | {_f(v['output_tok_per_s'], 3)} | {_f(v['ttft_p50'], 3)} | "
                f"{_f(v['itl_p50'], 3)} |"
            )
            if paired:
                p = v.get("paired", {})
                row += (
                    f" {_f(p.get('output_tok_per_s'), 3)} | {_f(p.get('ttft_p50'), 3)} | "
                    f"{_f(p.get('itl_p50'), 3)} | {p.get('rounds', '-')} |"
                )
            lines.append(row)
        if paired:
            lines += [
                "",
                "Pooled: over every round's requests. Paired: the median over rounds of the "
                "two servers' ratio in that round (each round sends each server the same "
                "prompts, one server after the other).",
            ]
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.md, and the PNGs when matplotlib is importable."""
    paths = [out_dir / "results.md"]
    paths[0].write_text(markdown(results), encoding="utf-8")
    from bench.plots import plot

    with contextlib.suppress(ImportError):  # no matplotlib: tables only
        paths += plot(results, out_dir)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args(argv)
    results = json.loads((args.results_dir / "results.json").read_text())
    for path in write_report(results, args.results_dir):
        print(path)


if __name__ == "__main__":
    main()
