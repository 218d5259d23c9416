"""The vocabulary product by column tiles (EngineConfig.lm_head_tile_bytes) on a real engine:
the backend's choice, and tokens that still do not depend on the batch a request runs in."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.config import load_model_config, tensor_parallel
from engine.engine import HEAD_TILE_BYTES, Engine, EngineConfig, head_tile
from engine.mesh import default_mesh
from engine.types import SamplingParams
from tests.engine.test_batch_invariance import TARGET, run_alone, run_among_others

TILE = 96  # columns: the tiny vocabulary of 512 in 6 tiles of 86, the last overlapping


@pytest.fixture(scope="module")
def tiled_engine(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    hidden = load_model_config(folder).hidden_size
    tiles = TILE * hidden * 4
    return Engine(EngineConfig(folder, max_slots=4, max_model_len=64, lm_head_tile_bytes=tiles))


def test_the_cpu_backend_tiles_a_whole_head_and_keeps_a_split_one_whole(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    cfg = dataclasses.replace(load_model_config(folder), vocab_size=128_256)
    one = default_mesh(1)
    assert head_tile(EngineConfig(folder), cfg, one) == HEAD_TILE_BYTES // (cfg.hidden_size * 4)
    assert head_tile(EngineConfig(folder, dtype="bfloat16"), cfg, one) == HEAD_TILE_BYTES // (
        cfg.hidden_size * 2
    )
    assert head_tile(EngineConfig(folder, lm_head_tile_bytes=0), cfg, one) == 0
    assert head_tile(EngineConfig(folder), load_model_config(folder), one) == 0  # 512 fit one
    split = tensor_parallel(load_model_config(folder), 2)
    assert split.head_shards == 2
    assert head_tile(EngineConfig(folder, tensor_parallel_size=2), split, default_mesh(2)) == 0
    asked = EngineConfig(folder, tensor_parallel_size=2, lm_head_tile_bytes=1 << 20)
    with pytest.raises(ValueError, match="whole head"):
        head_tile(asked, split, default_mesh(2))
    with pytest.raises(ValueError, match="lm_head_tile_bytes"):
        EngineConfig(folder, lm_head_tile_bytes=-1)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1.0, seed=1234)],
    ids=["greedy", "seeded-temperature-1"],
)
def test_tokens_same_alone_and_in_a_full_batch(tiled_engine, sampling):
    assert tiled_engine.model_config.head_tile == TILE
    assert run_alone(tiled_engine, sampling) == run_among_others(tiled_engine, sampling)


def test_logits_match_the_one_product_engine_and_keep_their_bits_across_buckets(
    tiled_engine, small_engine
):
    """Bucket 2 (the request alone with one idle slot) and bucket 4 (beside three others)
    give the request the same bits; and those are the one-product engine's, within float32
    rounding (its product sums in another order)."""
    greedy = SamplingParams(temperature=0.0, seed=0)
    assert small_engine.model_config.head_tile == 0  # 512 columns fit one default tile

    def logits(engine: Engine, neighbours: bool) -> list[np.ndarray]:
        state = engine.insert(engine.prefill(TARGET, greedy), engine.init_state(), 0)
        if neighbours:
            for slot, prompt in ((1, [0, 5, 9]), (2, list(range(40, 60))), (3, [0, 77])):
                state = engine.insert(engine.prefill(prompt, greedy), state, slot)
        rows = []
        for _ in range(3):
            state, _, out = engine.generate_with_logits(state, 4 if neighbours else 2)
            rows.append(np.asarray(out[0]))
        return rows

    tiled = logits(tiled_engine, neighbours=True)
    for alone, busy in zip(logits(tiled_engine, neighbours=False), tiled, strict=True):
        np.testing.assert_array_equal(alone, busy)
    for mine, whole in zip(tiled, logits(small_engine, neighbours=True), strict=True):
        np.testing.assert_allclose(mine, whole, rtol=1e-5, atol=1e-5)
    assert dataclasses.replace(tiled_engine.model_config, head_tile=0) == small_engine.model_config
