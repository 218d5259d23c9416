"""bench.gpu_decode runs end to end on whatever backend jax has (the CPU here): the
script a lent GPU runs must not rot between loans. Tiny shapes and the XLA form of the
GPU attention keep it to seconds (the Pallas kernel's interpreter is checked in
tests/engine/test_attention_gpu.py)."""

from __future__ import annotations

from bench import gpu_decode

ARGS = ["--configs", "tiny", "--context", "20", "--steps", "2", "--prefill-repeats", "1"]


def test_decode_and_prefill_figures() -> None:
    decode, prefill = gpu_decode.main(
        [
            *ARGS,
            "--batches",
            "2",
            "--prefill",
            "48",
            "--prefill-chunk",
            "16",
            "--attention",
            "gpu-xla",
        ]
    )
    assert decode["kind"] == "decode" and decode["batch"] == 2 and decode["layers"] == 2
    assert decode["attention"] == "gpu-xla" and decode["page_size"] == 16
    assert decode["step_ms"] > 0 and decode["tokens_per_s"] > 0
    cfg = gpu_decode.TINY  # every weight once (the tied head is the embedding), the live K/V
    kv = 2 * 21 * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * cfg.num_layers
    assert decode["bytes_per_step"] > cfg.vocab_size * cfg.hidden_size * 2 + kv
    assert 0 <= decode["bandwidth_utilization"] < 1
    assert prefill["kind"] == "prefill" and prefill["prompt"] == 48 and prefill["chunk"] == 16
    assert prefill["tokens_per_s"] > 0 and 0 <= prefill["flop_utilization"] < 1
    layer = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.hidden_size * cfg.q_size
    layer += 3 * cfg.intermediate_size * cfg.hidden_size
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 48 * 48
    assert prefill["flops"] == 2 * layer * cfg.num_layers * 48 + attention


def test_reference_attention_without_command_buffers() -> None:
    (row,) = gpu_decode.main(
        [
            *ARGS,
            "--batches",
            "1",
            "--prefill",
            "",
            "--attention",
            "reference",
            "--no-command-buffers",
            "--xla-reduce",
        ]
    )
    assert row["attention"] == "reference" and row["command_buffers"] is False
    assert row["xla_reduce"] is True and row["tokens_per_s"] > 0
