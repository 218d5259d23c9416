"""Plots of a serving run: throughput and latency percentiles vs concurrency, per server.

Run: `python -m bench.plots RESULTS_DIR` redraws the PNGs from RESULTS_DIR/results.json.
Needs matplotlib (the `bench` extra); draws off-screen (Agg).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_PNG = "latency_vs_concurrency.png"


def _series(run: dict[str, Any], key: str, sub: str | None = None) -> tuple[list, list]:
    xs, ys = [], []
    for level in run["sweep"]:
        value = level[key] if sub is None else level[key][sub]
        if value == value:  # NaN when a level had no successful request
            xs.append(level["concurrency"])
            ys.append(value)
    return xs, ys


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["servers"] if "sweep" in r]
    title = f"{results['model']}, {results['workload']} workload, {results['max_slots']} slots"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ax.plot(*_series(run, "output_tok_per_s"), marker="o", label=run["server"])
    limit = results["ratios"]["engine_only_tok_per_s"]
    ax.axhline(
        limit, color="grey", linestyle="--", label=f"engine only ({results['max_slots']} slots)"
    )
    ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens/s")
    ax.set_title(title, fontsize=10)
    _concurrency_ticks(ax, runs)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / THROUGHPUT_PNG)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "ITL"), strict=True):
        for i, run in enumerate(runs):
            color = f"C{i}"
            ax.plot(
                *_series(run, key, "p50"), marker="o", color=color, label=f"{run['server']} p50"
            )
            dashed = {"marker": "^", "linestyle": "--", "color": color}
            ax.plot(*_series(run, key, "p99"), **dashed, label=f"{run['server']} p99")
        ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel=f"{label} (ms)")
        ax.set_title(f"{label} percentiles", fontsize=10)
        _concurrency_ticks(ax, runs)
        ax.grid(True, which="both", alpha=0.3)
        if runs:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / LATENCY_PNG)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _concurrency_ticks(ax: Any, runs: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import NullLocator

    levels = sorted({lv["concurrency"] for r in runs for lv in r["sweep"]})
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.xaxis.set_minor_locator(NullLocator())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args(argv)
    results = json.loads((args.results_dir / "results.json").read_text())
    for path in plot(results, args.results_dir):
        print(path)


if __name__ == "__main__":
    main()
