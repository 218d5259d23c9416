"""bench.tpu_aot: every program of the engine core compiles for TPU topologies (v5e:2x2
and v6e:2x2, 2-layer forms of the 1B and 8B shapes), fits the chip, and its steps move
a bounded multiple of the bytes they must (ahead-of-time, on the CPU: libtpu describes
the chips; nothing runs on them)."""

from __future__ import annotations

import pytest

pytest.importorskip("libtpu")  # the test extra brings it (jax[tpu])

from bench import tpu_aot  # noqa: E402

# HBM bytes a step accesses over the bytes it must (bench.tpu_aot): the bounds.
DECODE_RATIO = 1.3
PREFILL_RATIO = 1.5


def run(config: str, topology: str, tp: int, programs: str, *extra: str) -> dict:
    return tpu_aot.main(
        [
            "--config", config, "--topology", topology, "--tensor-parallel-size", str(tp),
            "--layers", "2", "--max-num-seqs", "16", "--max-model-len", "2048",
            "--programs", programs, *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("config", "topology", "tp"),
    [("1b", "v5e:2x2", 1), ("1b", "v6e:2x2", 1), ("8b", "v5e:2x2", 4), ("8b", "v6e:2x2", 4)],
)
def test_paged_programs_compile_fit_and_move_few_bytes(config: str, topology: str, tp: int) -> None:
    report = run(config, topology, tp, "decode,prefill,mixed,prompt-logprobs")
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {
        "decode-16", "decode-1", "prefill-1024", "mixed-16", "prompt-logprobs-256"
    }  # fmt: skip
    for p in programs.values():
        assert p["compiled"] and p["error"] is None, (p["name"], p["error"])
        assert 0 < p["peak_bytes_per_chip"] <= p["hbm_bytes_per_chip"]
        assert p["unavoidable_bytes"] > 0 and p["ratio"] >= 1.0
    for name in ("decode-16", "decode-1"):
        assert programs[name]["ratio"] <= DECODE_RATIO, programs[name]
    for name in ("prefill-1024", "mixed-16"):
        assert programs[name]["ratio"] <= PREFILL_RATIO, programs[name]


def test_a_program_that_does_not_fit_is_reported() -> None:
    report = run("8b", "v5e:2x2", 4, "decode", "--num-pages", "70000")
    for p in report["programs"]:
        assert not p["compiled"] or p["peak_bytes_per_chip"] > p["hbm_bytes_per_chip"], p
        assert p["error"] and ("HBM" in p["error"] or "bytes" in p["error"]), p


def test_int8_weights_halve_the_bytes_a_decode_step_reads() -> None:
    """--quantization int8 with an fp8 KV cache: the 1-sequence decode step (its bytes the
    weights', mostly) reads at most 0.55x the bfloat16 step's, every step within the bounds
    above against its own (int8 and fp8) unavoidable bytes."""
    base = {p["name"]: p for p in run("1b", "v5e:2x2", 1, "decode")["programs"]}
    quant = run("1b", "v5e:2x2", 1, "decode", "--quantization", "int8", "--kv-cache-dtype", "fp8")
    programs = {p["name"]: p for p in quant["programs"]}
    for name, p in programs.items():
        assert p["compiled"] and p["error"] is None, (name, p["error"])
        assert 1.0 <= p["ratio"] <= DECODE_RATIO, p
        assert p["bytes_accessed"] < base[name]["bytes_accessed"], name
    assert programs["decode-1"]["bytes_accessed"] <= 0.55 * base["decode-1"]["bytes_accessed"]
