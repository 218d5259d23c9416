"""bench.tpu_aot: every program of the engine core compiles for TPU topologies (v5e:2x2
and v6e:2x2, 2-layer forms of the 1B and 8B shapes), fits the chip, moves a bounded
multiple of the bytes it must, and its roofline time (max of FLOPs over peak and bytes
over bandwidth) stays a bounded multiple of its unavoidable work's (ahead-of-time, on
the CPU: libtpu describes the chips; nothing runs on them).

Bounded by default (the compiles take minutes on two cores): one topology per model
shape, 1B on v5e and 8B at TP 4 on v6e, up to 8 sequences a step, and the int8 and LoRA
checks at their smallest decode batches. TPU_AOT_FULL=1 compiles every form: both shapes
on both chips, up to 16 sequences."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("libtpu")  # the test extra brings it (jax[tpu])

from bench import tpu_aot  # noqa: E402
from engine.core.core import CHUNK_SIZE  # noqa: E402

# Bytes a step accesses, and its roofline time, over its unavoidable work's. Two layers
# beside a 128,256-token head and sampling's passes over it, and a chunk's activations
# all counted in HBM: looser than the full models' (bench/README.md, "TPU programs").
DECODE_RATIO = 1.35
# chunks of 1,024 (TPU's): a chunk's activations outweigh 2 layers' weights, read once for
# the whole prompt; a lone chunk pads to the step's whole budget, 1,032 tokens
# (engine.core.runner.Shapes): measured 1.90-1.92 (1B), 2.17-2.21 (8B at TP 4)
PREFILL_RATIO = 2.3
QUANT_DECODE_RATIO = 1.6  # int8 weights: sampling's passes weigh more beside them
# The attention kernel's FLOPs over causal attention's: head folding (head_dim 64, two
# kv heads a row of lanes) doubles them and whole blocks of positions add the rest; a
# decode row multiplied against its block's other rows' KV would be 16x here.
ATTENTION_FLOPS_RATIO = 2.5
# A LoRA pool of 4 rank-16 slots over the base program's bytes (2 layers of the 1B shape,
# measured: decode 1.02, the 1,024-token prompt in one chunk 1.22: its (tokens, slots,
# rank) products)
LORA_DECODE_OVER_BASE = 1.05
LORA_PREFILL_OVER_BASE = 1.25

FULL = os.environ.get("TPU_AOT_FULL", "0") not in ("", "0")
TOPOLOGIES = [("1b", "v5e:2x2", 1), ("8b", "v6e:2x2", 4)]
TOPOLOGIES += [("1b", "v6e:2x2", 1), ("8b", "v5e:2x2", 4)] if FULL else []
SEQS = 16 if FULL else 8  # decode batches of 1, 8 (and 16) sequences; the mixed step's rows
# the int8 and LoRA checks' decode batches: 1 sequence, or every one with TPU_AOT_FULL
FEW_SEQS = () if FULL else ("--max-num-seqs", "1")


def run(config: str, topology: str, tp: int, programs: str, *extra: str) -> dict:
    return tpu_aot.main(
        [
            "--config", config, "--topology", topology, "--tensor-parallel-size", str(tp),
            "--layers", "2", "--max-num-seqs", str(SEQS), "--max-model-len", "2048",
            "--programs", programs, *extra,
        ]
    )  # fmt: skip


def by_name(report: dict) -> dict[tuple[str, str | None, str], dict]:
    return {(p["name"], p["sampling"], p["contexts"]): p for p in report["programs"]}


@pytest.mark.parametrize(("config", "topology", "tp"), TOPOLOGIES)
def test_paged_programs_compile_fit_and_stay_near_their_roofline(
    config: str, topology: str, tp: int
) -> None:
    programs = by_name(run(config, topology, tp, "decode,prefill,mixed,prompt-logprobs"))
    decodes = {
        (f"decode-{n}", sampling, contexts)
        for n in sorted({1, 8, SEQS})
        for sampling in ("greedy", "sampled")
        for contexts in ("full", "mixed")
    }
    others = {
        ("prefill-1024", "sampled", "full"),
        (f"mixed-{SEQS}", "sampled", "full"),
        (f"prompt-logprobs-{CHUNK_SIZE['tpu']}", None, "full"),
    }
    assert set(programs) == decodes | others
    for p in programs.values():
        assert p["compiled"] and p["error"] is None, (p["name"], p["error"])
        assert 0 < p["peak_bytes_per_chip"] <= p["hbm_bytes_per_chip"]
        assert p["unavoidable_bytes"] > 0 and p["ratio"] >= 1.0
        assert p["unavoidable_flops"] > 0 and p["flops"] >= p["unavoidable_flops"]
        assert p["time_ratio"] >= 1.0 and p["bound"] in ("hbm", "flops")
    for key in decodes | others - {(f"prompt-logprobs-{CHUNK_SIZE['tpu']}", None, "full")}:
        p = programs[key]  # a step's figure less its logit-bias and allowed-token branches
        assert p["bias_mask_bytes"] > 0 and p["bias_mask_flops"] > 0, p
        plain = p["bytes_accessed"] - p["bias_mask_bytes"]
        assert p["plain_bytes_accessed"] == pytest.approx(plain) and p["plain_flops"] < p["flops"]
        assert 1.0 <= p["plain_time_ratio"] <= p["time_ratio"], p
    for key in decodes:
        p = programs[key]
        assert p["ratio"] <= DECODE_RATIO and p["time_ratio"] <= DECODE_RATIO, p
        assert p["attention_flops_ratio"] <= ATTENTION_FLOPS_RATIO, p
    mixed = programs[(f"decode-{SEQS}", "sampled", "mixed")]
    full = programs[(f"decode-{SEQS}", "sampled", "full")]
    assert mixed["kv_positions"] < full["kv_positions"]
    for key in others - {(f"prompt-logprobs-{CHUNK_SIZE['tpu']}", None, "full")}:
        p = programs[key]
        assert p["ratio"] <= PREFILL_RATIO and p["time_ratio"] <= PREFILL_RATIO, p
    prefill = programs[("prefill-1024", "sampled", "full")]
    assert prefill["once_time_ratio"] >= prefill["time_ratio"]  # its chunks' weights named


def test_a_program_that_does_not_fit_is_reported() -> None:
    report = run("8b", "v5e:2x2", 4, "decode", "--num-pages", "600000")
    for p in report["programs"]:
        assert not p["compiled"] or p["peak_bytes_per_chip"] > p["hbm_bytes_per_chip"], p
        assert p["error"] and ("HBM" in p["error"] or "bytes" in p["error"]), p


def test_chip_peaks_set_the_roofline() -> None:
    """A chip with a thousandth of v5e's FLOP/s: the same decode step is FLOPs-bound."""
    slow = run("1b", "v5e:2x2", 1, "decode", "--max-num-seqs", "1", "--chip-peaks", "197e9,819e9")
    (p, *_) = slow["programs"]
    assert p["bound"] == "flops" and p["roofline_s"] == pytest.approx(p["flops"] / 197e9)


def test_int8_weights_halve_the_bytes_a_decode_step_reads() -> None:
    """--quantization int8 with an fp8 KV cache: the 1-sequence decode step (its bytes the
    weights', mostly; sampling's passes over the logits are not halved) reads at most
    0.56x the bfloat16 step's, every step within the bounds
    above against its own (int8 and fp8) unavoidable bytes."""
    base = by_name(run("1b", "v5e:2x2", 1, "decode", *FEW_SEQS))
    quant = run(
        "1b", "v5e:2x2", 1, "decode", *FEW_SEQS, "--quantization", "int8", "--kv-cache-dtype", "fp8"
    )
    programs = by_name(quant)
    for key, p in programs.items():
        assert p["compiled"] and p["error"] is None, (key, p["error"])
        assert 1.0 <= p["ratio"] <= QUANT_DECODE_RATIO, p
        assert p["bytes_accessed"] < base[key]["bytes_accessed"], key
    one = ("decode-1", "greedy", "full")
    assert programs[one]["bytes_accessed"] <= 0.56 * base[one]["bytes_accessed"]


def test_the_step_with_a_lora_pool_compiles_and_states_its_bytes_over_the_base() -> None:
    """--lora: a pool of 4 rank-16 adapters (the defaults) beside the 1B shape's layers;
    every program compiles and fits, and reads a little more than the base program."""
    report = run("1b", "v5e:2x2", 1, "decode,prefill", "--lora", *FEW_SEQS)
    assert (report["setup"]["max_loras"], report["setup"]["max_lora_rank"]) == (4, 16)
    for p in report["programs"]:
        assert p["compiled"] and p["error"] is None, (p["name"], p["error"])
        assert p["ratio"] >= 1.0 and p["time_ratio"] >= 1.0
    over = report["lora_over_base"]
    assert len(over) == len(report["programs"])
    for entry in over:
        bound = (
            LORA_PREFILL_OVER_BASE if entry["name"].startswith("prefill") else LORA_DECODE_OVER_BASE
        )
        assert 1.0 < entry["over_base"] <= bound, entry
