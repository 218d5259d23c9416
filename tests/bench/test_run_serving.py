"""The serving runner's rounds: every server up at once, each level sent to each in turn.

Against two scripted SSE servers on 127.0.0.1, one answering more slowly than the other:
counts and prompts are exact, and the per-round ratios come out on the side the scripts
make impossible to miss.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

from bench import servers
from bench.report import markdown
from bench.run_serving import bench_interleaved, ratios
from bench.workload import Vocabulary, Workload
from tests.bench.fake_sse import Script, serve


class Every(dict):
    """The same script for whatever prompt comes."""

    def __init__(self, script: Script):
        super().__init__()
        self.script = script

    def __missing__(self, key: int) -> Script:
        return self.script


def running(name: str, base_url: str, tmp_path: Path) -> servers.Running:
    spec = servers.ServerSpec(name, ("python", "-m", name))
    idle = subprocess.Popen(["true"])
    idle.wait()
    return servers.Running(spec, base_url.removesuffix("/v1"), idle, tmp_path / f"{name}.log")


def test_rounds_send_every_server_the_same_prompts_and_pair_their_figures(tmp_path: Path) -> None:
    fast = Script(first_s=0.01, gaps_s=(0.005,) * 3, usage_tokens=4)
    slow = Script(first_s=0.15, gaps_s=(0.005,) * 3, usage_tokens=4)
    workload = Workload.load("burst_short").resolve(1024)
    levels = [1, 3]
    with serve(Every(fast)) as a, serve(Every(slow)) as b:
        runs = bench_interleaved(
            [running("ours", a.base_url, tmp_path), running("peer", b.base_url, tmp_path)],
            "m", workload, Vocabulary(1000), None, levels, 2, None, 30.0, 3,
        )  # fmt: skip
        prompts = [Counter(tuple(body["prompt"]) for body in fake.bodies) for fake in (a, b)]
    assert prompts[0] == prompts[1]  # the same prompts, each server
    # per round: 1 + 3 requests and a probe of 2, each round's its own; one warm-up of 2
    assert sum(prompts[0].values()) == 3 * (1 + 3 + 2) + 2
    assert len(prompts[0]) == 3 * (1 + 3 + 2) + 2  # none sent twice to one server
    ours, peer = runs
    assert [lv["requests"] for lv in ours["sweep"]] == [3, 9]  # rounds pooled
    assert [len(lv["rounds"]) for lv in ours["sweep"]] == [3, 3]
    r = ratios({"before": {"tok_per_s": 1.0}, "after": {"tok_per_s": 1.0}}, runs)
    for level in ("1", "3"):
        paired = r["ours_over_peer"][level]["paired"]
        assert paired["rounds"] == 3
        assert paired["ttft_p50"] < 0.5  # 10 ms against 150 ms, whatever the machine
        assert paired["output_tok_per_s"] > 1.0
    results = {
        "machine": {"cpu": "c", "cores": 2, "memory_gib": 1, "python": "3", "jax": "0",
                    "date": "d"},
        "model": "m", "workload": "burst_short", "max_slots": 2, "context": 1024,
        "dtype": "float32", "engine_only": {"before": {"tok_per_s": 1.0},
                                           "after": {"tok_per_s": 1.0}},
        "workload_resolved": {"input_tokens": [128, 128], "shared_prefix_tokens": 0,
                              "output_tokens": [64, 64], "arrival": "burst"},
        "servers": runs, "ratios": r,
    }  # fmt: skip
    assert "paired: output tok/s | TTFT p50 | ITL p50 | rounds |" in markdown(results)


def test_full_occupancy_pairs_each_round_with_the_engine_run_after_it() -> None:
    """A machine that slows by half in round 2 halves both figures of that round: paired,
    the ratio holds; against the larger engine-alone figure of the run it would not."""
    full = {"requests": 2, "output_tok_per_s": 90.0, "per_round": [100.0, 50.0, None],
            "engine_only_per_round": [125.0, 62.5, 120.0]}  # fmt: skip
    alone = {"requests": 2, "output_tok_per_s": 90.0}
    runs = [{"server": "ours", "sweep": [], "full_occupancy": full},
            {"server": "peer", "sweep": [], "full_occupancy": alone}]  # fmt: skip
    r = ratios({"before": {"tok_per_s": 125.0}, "after": {"tok_per_s": 100.0}}, runs)
    assert r["ours"]["full_occupancy_over_engine_paired"] == 0.8  # a failed round is left out
    assert r["ours"]["full_occupancy_over_engine"] == 90.0 / 125.0
    assert "full_occupancy_over_engine_paired" not in r["peer"]
