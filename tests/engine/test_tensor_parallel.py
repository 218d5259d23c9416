"""Tensor parallelism on 4 CPU devices: the same tokens and logits as one device, really sharded.

tests/conftest.py gives the session four CPU devices
(--xla_force_host_platform_device_count=4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from engine.checkpoint import load_params
from engine.config import load_model_config, tensor_parallel
from engine.engine import Engine, EngineConfig
from engine.types import SamplingParams
from tests.engine.conftest import batch_lengths
from tests.engine.test_recompile import compile_events  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, seed=0)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=3, logprobs=2)
PROMPTS = ([0, 42, 364, 78, 81, 277, 67], [5, 9, 300, 12], list(range(3, 40)))
STEPS = 8
# (arch, config overrides, sizes): GQA, its 2 kv heads split by 2 devices and replicated
# on 4; q/k/v biases; tied embeddings with a vocabulary 4 devices cannot split (the head is
# then replicated).
CASES = {
    "llama": ("llama", {}, (2, 4)),
    "qwen2": ("qwen2", {}, (2,)),
    "tied-514": ("llama_tied", {"vocab_size": 514}, (4,)),
}


def small(folder: Path, tp: int, **options: Any) -> Engine:
    return Engine(
        EngineConfig(
            folder,
            max_slots=4,
            max_model_len=64,
            prefill_buckets=(16, 64),
            prefill_chunk=None,
            tensor_parallel_size=tp,
            **options,
        )
    )


def run(engine: Engine) -> tuple[list[list[int]], np.ndarray]:
    """Each prompt's tokens (greedy and seeded slots side by side) and every step's logits."""
    state = engine.init_state()
    tokens: list[list[int]] = []
    for slot, prompt in enumerate(PROMPTS):
        prefix = engine.prefill(prompt, GREEDY if slot % 2 == 0 else SEEDED)
        state = engine.insert(prefix, state, slot)
        tokens.append([int(prefix.token)])
    logits = []
    for _ in range(STEPS):
        state, out, step_logits = engine.generate_with_logits(state)
        for slot, seq in enumerate(tokens):
            seq.append(int(np.asarray(out.tokens)[slot]))
        logits.append(np.asarray(step_logits)[: len(PROMPTS)])
    return tokens, np.stack(logits)


def test_four_cpu_devices_are_there():
    assert len(jax.devices()) >= 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tokens_and_logits_as_one_device(tiny_checkpoint_of, case):
    arch, overrides, sizes = CASES[case]
    checkpoint = tiny_checkpoint_of(arch, **overrides)
    want_tokens, want_logits = run(small(checkpoint, 1))
    for tp in sizes:
        tokens, logits = run(small(checkpoint, tp))
        assert tokens == want_tokens, tp
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_params_and_cache_are_sharded(tiny_checkpoint_of, tp):
    engine = small(tiny_checkpoint_of("llama"), tp)
    cfg = engine.model_config
    assert engine.mesh.devices.size == tp
    layer = engine.params["layers"][0]
    expect = {"wqkv": ("model",), "wo": (None, "model"), "w_gate_up": ("model",)}
    expect["w_down"] = (None, "model")  # (out, in) matrices: split by output, then input
    for name, spec in expect.items():
        array = layer[name]
        assert array.sharding.spec == PartitionSpec(*spec), name
        shards = array.addressable_shards
        assert len({s.device for s in shards}) == tp
        axis = len(spec) - 1
        assert all(s.data.shape[axis] * tp == array.shape[axis] for s in shards), name
    assert engine.params["lm_head"].sharding.spec == PartitionSpec(None, "model")
    assert engine.params["embed"].sharding.is_fully_replicated
    state = engine.init_state()
    prefix = engine.prefill(PROMPTS[0], GREEDY)
    state = engine.insert(prefix, state, 0)
    state, _ = engine.generate(state)
    for cache in (state.k_cache[0][0], state.v_cache[-1][-1]):
        assert cache.sharding.spec == PartitionSpec(None, "model")
        assert {s.data.shape[1] for s in cache.addressable_shards} == {cfg.num_kv_heads // tp}
    # 2 kv heads on 4 devices: each device keeps a copy of its query heads' kv head
    assert cfg.num_kv_heads == max(2, tp) and cfg.kv_replicas == max(1, tp // 2)


def test_a_vocabulary_the_devices_cannot_split_keeps_a_copy_of_the_head(tiny_checkpoint_of):
    engine = small(tiny_checkpoint_of("llama_tied", vocab_size=514), 4)
    assert engine.model_config.head_shards == 1
    assert engine.params["lm_head"].sharding.is_fully_replicated


def test_each_shard_is_read_as_a_slice_of_the_checkpoint(tiny_checkpoint_of):
    """Shards hold 1/tp of every split weight, and together exactly the checkpoint's."""
    folder = tiny_checkpoint_of("qwen2")
    whole = load_params(folder, load_model_config(folder))
    cfg = tensor_parallel(load_model_config(folder), 2)
    shards = [load_params(folder, cfg, shard=i) for i in range(2)]
    q, kv = cfg.q_size, cfg.kv_size
    for i, shard in enumerate(shards):
        lp, full = shard["layers"][1], whole["layers"][1]
        assert lp["wqkv"].shape[0] * 2 == full["wqkv"].shape[0]
        half_q, half_kv = q // 2, kv // 2
        np.testing.assert_array_equal(
            lp["wqkv"][:half_q], full["wqkv"][i * half_q : (i + 1) * half_q]
        )
        k_rows = full["wqkv"][q + i * half_kv : q + (i + 1) * half_kv]
        np.testing.assert_array_equal(lp["wqkv"][half_q : half_q + half_kv], k_rows)
        np.testing.assert_array_equal(lp["wo"], full["wo"][:, i * half_q : (i + 1) * half_q])
        np.testing.assert_array_equal(
            lp["bqkv"][:half_q], full["bqkv"][i * half_q : (i + 1) * half_q]
        )
    np.testing.assert_array_equal(np.concatenate([s["lm_head"] for s in shards]), whole["lm_head"])
    np.testing.assert_array_equal(shards[0]["embed"], whole["embed"])


@pytest.fixture(scope="module")
def warmed_tp2(tiny_checkpoint_of: Any) -> Engine:
    engine = small(tiny_checkpoint_of("llama"), 2, max_prefill_batch=2)
    engine.warmup()
    return engine


def test_no_compile_after_warmup(warmed_tp2, compile_events):  # noqa: F811
    engine = warmed_tp2
    state = engine.init_state()
    for length in (1, 7, 16, 17, 40, 63):
        prompt = [(5 * i) % 500 for i in range(length)]
        prefix = engine.prefill(prompt, SEEDED, prompt_logprobs=length == 7)
        slot = length % engine.max_slots
        state = engine.insert(prefix, engine.free(state, slot), slot)
        for batch in engine.decode_buckets:
            state, out = engine.generate(state, batch)
    long, short = batch_lengths(engine) or pytest.fail("no batched prefill shape")
    engine.prefill_batch([((PROMPTS[2] * 2)[:long], GREEDY), ((PROMPTS[2] * 2)[:short], SEEDED)])
    jax.block_until_ready(out.tokens)
    assert compile_events == []


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "num_attention_heads 4, intermediate_size 128"),
        (8, "num_attention_heads"),  # more devices than heads: 8 does not divide 4
    ],
)
def test_a_size_that_does_not_divide_the_model_is_a_clear_error(tiny_checkpoint_of, tp, message):
    with pytest.raises(ValueError, match=message):
        tensor_parallel(load_model_config(tiny_checkpoint_of("llama")), tp)


def test_more_devices_than_there_are_is_a_clear_error(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama", num_attention_heads=8, head_dim=8)  # 8 divides it
    with pytest.raises(ValueError, match=f"num_devices must be in 1..{len(jax.devices())}"):
        small(folder, 8)


def test_devices_that_do_not_exist_are_a_clear_error(tiny_checkpoint_of):
    with pytest.raises(ValueError, match=r"devices \[0, 9\]"):
        small(tiny_checkpoint_of("llama"), 2, devices=(0, 9))
