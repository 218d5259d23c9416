"""Tensor parallelism of the engine core on 4 CPU devices (tests/conftest.py gives the
session four): the same tokens and logprobs as one device, params and KV pages really
split over the mesh, each shard read as a slice of the checkpoint, no compile after
warm-up, and every misconfiguration a clear error."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from engine.checkpoint import load_params
from engine.config import load_model_config, tensor_parallel
from engine.core.scheduler import SequenceState
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core
from tests.engine.core.test_recompile import compile_events  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=3, logprobs=2)
PROMPTS = ((0, 42, 364, 78, 81, 277, 67), (5, 9, 300, 12), tuple(range(3, 40)))
STEPS = 8
# (arch, config overrides, sizes): GQA, its 2 kv heads split by 2 devices and replicated
# on 4; q/k/v biases; tied embeddings with a vocabulary 4 devices cannot split (the head
# is then a copy on each).
CASES = {
    "llama": ("llama", {}, (2, 4)),
    "qwen2": ("qwen2", {}, (2,)),
    "tied-514": ("llama_tied", {"vocab_size": 514}, (4,)),
}


def run(folder: Path, tp: int) -> dict[str, list[tuple[int, float]]]:
    seqs = [
        SequenceState(f"s{i}", p, GREEDY if i % 2 == 0 else SEEDED, STEPS)
        for i, p in enumerate(PROMPTS)
    ]
    events = run_core(core_of(folder, tensor_parallel_size=tp), seqs)
    return {k: [(e.token, e.logprob) for e in v] for k, v in events.items()}


def test_four_cpu_devices_are_there() -> None:
    assert len(jax.devices()) >= 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tokens_and_logprobs_as_one_device(tiny_checkpoint_of, case: str) -> None:  # type: ignore[no-untyped-def]
    arch, overrides, sizes = CASES[case]
    folder = tiny_checkpoint_of(arch, **overrides)
    want = run(folder, 1)
    for tp in sizes:
        got = run(folder, tp)
        for name in want:
            assert [t for t, _ in got[name]] == [t for t, _ in want[name]], (tp, name)
            np.testing.assert_allclose(
                [lp for _, lp in got[name]], [lp for _, lp in want[name]], atol=1e-5
            )


@pytest.mark.parametrize("tp", [2, 4])
def test_params_and_pages_are_split_over_the_mesh(tiny_checkpoint_of, tp: int) -> None:  # type: ignore[no-untyped-def]
    core = core_of(tiny_checkpoint_of("llama"), tensor_parallel_size=tp)
    cfg = core.model_config
    params = core.runner.params
    assert core.mesh.devices.size == tp
    expect = {"wqkv": ("model",), "wo": (None, "model"), "w_gate_up": ("model",)}
    expect["w_down"] = (None, "model")  # (out, in) matrices: split by output, then input
    for name, spec in expect.items():
        array = params["layers"][name]  # every layer's, stacked on a leading axis
        assert array.sharding.spec == PartitionSpec(None, *spec), name
        axis = len(spec)
        assert all(s.data.shape[axis] * tp == array.shape[axis] for s in array.addressable_shards)
    assert params["embed"].sharding.spec == PartitionSpec("model")  # by vocabulary rows
    # on CPU the untied head is kept hidden-major (engine.paged_model.hidden_major_head)
    assert "lm_head" not in params
    assert params["lm_head_t"].sharding.spec == PartitionSpec(None, "model")
    assert params["lm_head_t"].shape == (cfg.hidden_size, cfg.vocab_size)
    pages = core.runner.pages  # every layer's (KVLayout.stacked)
    assert pages.sharding.spec == PartitionSpec(None, None, "model", None)
    assert {s.data.shape[2] for s in pages.addressable_shards} == {2 * cfg.num_kv_heads // tp}
    # 2 kv heads on 4 devices: each device keeps a copy of its query heads' kv head
    assert cfg.num_kv_heads == max(2, tp) and cfg.kv_replicas == max(1, tp // 2)


def test_a_tied_head_is_the_embedding_and_an_unsplittable_one_a_copy(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    tied = core_of(tiny_checkpoint_of("llama_tied"), tensor_parallel_size=2).runner.params
    assert "lm_head" not in tied and tied["embed"].sharding.spec == PartitionSpec("model")
    odd = core_of(tiny_checkpoint_of("llama_tied", vocab_size=514), tensor_parallel_size=4)
    assert odd.model_config.head_shards == 1
    assert odd.runner.params["embed"].sharding.is_fully_replicated


def test_each_shard_is_read_as_a_slice_of_the_checkpoint(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
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


def test_no_compile_after_warmup_on_two_devices(tiny_checkpoint_of, compile_events) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    core = core_of(tiny_checkpoint_of("llama"), tensor_parallel_size=2)
    core.warmup()
    compile_events.clear()
    seqs = [
        SequenceState(f"s{n}", tuple((5 * i) % 500 for i in range(n)), SEEDED, 6, prompt_logprobs=1)
        for n in (1, 7, 17, 40, 63)
    ]
    run_core(core, seqs)
    assert compile_events == []


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "num_attention_heads 4, intermediate_size 128"),
        (8, "num_attention_heads"),  # more devices than heads: 8 does not divide 4
    ],
)
def test_a_size_that_does_not_divide_the_model_is_a_clear_error(
    tiny_checkpoint_of, tp: int, message: str
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        core_of(tiny_checkpoint_of("llama"), tensor_parallel_size=tp)


def test_more_devices_than_there_are_is_a_clear_error(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama", num_attention_heads=8, head_dim=8)  # 8 divides it
    with pytest.raises(ValueError, match=f"num_devices must be in 1..{len(jax.devices())}"):
        core_of(folder, tensor_parallel_size=8)


def test_devices_that_do_not_exist_are_a_clear_error(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"devices \[0, 9\]"):
        core_of(tiny_checkpoint_of("llama"), tensor_parallel_size=2, devices=(0, 9))
