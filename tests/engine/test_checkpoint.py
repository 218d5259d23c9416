"""Checkpoint folders: config variants, sharded weights, bfloat16, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.core.scheduler import SequenceState
from engine.types import CheckpointError, SamplingParams
from tests.engine.conftest import core_of, run_core

GREEDY = SamplingParams(temperature=0.0, seed=0)
PROMPT = [0, 42, 364, 78, 81, 277, 67]


def greedy_tokens(folder: Path, dtype: str = "float32", steps: int = 6) -> list[int]:
    core = core_of(folder, dtype=dtype, max_num_seqs=2, max_model_len=32)
    events = run_core(core, [SequenceState("s", tuple(PROMPT), GREEDY, steps + 1)])["s"]
    return [e.token for e in events]


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))


def test_sharded_equals_unsharded(tiny_checkpoint_of):
    whole, sharded = tiny_checkpoint_of("qwen2"), tiny_checkpoint_of("qwen2", shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) == 3
    cfg = load_model_config(whole)
    a, b = load_params(whole, cfg), load_params(sharded, cfg)
    assert a.keys() == b.keys() and len(a["layers"]) == len(b["layers"]) == 2
    for name in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(a[name], b[name])
    for layer_a, layer_b in zip(a["layers"], b["layers"], strict=True):
        assert layer_a.keys() == layer_b.keys() and "bqkv" in layer_a
        for name in layer_a:
            np.testing.assert_array_equal(layer_a[name], layer_b[name])
    assert greedy_tokens(whole) == greedy_tokens(sharded)


def test_bfloat16_checkpoint_loads_and_runs(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama", dtype="bfloat16")
    params = load_params(folder, load_model_config(folder), "bfloat16")
    assert params["embed"].dtype.name == "bfloat16"
    tokens = greedy_tokens(folder, dtype="bfloat16")
    assert all(0 <= t < 512 for t in tokens)
    # the same bf16 weights run in float32 agree on the first greedy tokens
    assert greedy_tokens(folder, dtype="float32", steps=2)[:2] == tokens[:2]


def test_rope_parameters_and_rope_scaling_spell_the_same_config(tiny_checkpoint_of, tmp_path):
    old_style = load_model_config(tiny_checkpoint_of("llama3_rope"))
    folder = copy_of(tiny_checkpoint_of("llama3_rope"), tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = raw.pop("rope_scaling") | {"rope_theta": raw.pop("rope_theta")}
    (folder / "config.json").write_text(json.dumps(raw))
    new_style = load_model_config(folder)
    assert new_style == old_style
    assert old_style.rope_type == "llama3" and old_style.rope_theta == 500000.0
    plain = load_model_config(tiny_checkpoint_of("llama")).rope_inv_freq()
    assert not np.allclose(old_style.rope_inv_freq(), plain)
    assert old_style.eos_token_ids == (1, 2)  # a list in generation_config.json


def test_linear_rope_scaling_divides_frequencies(tiny_checkpoint_of, tmp_path):
    folder = copy_of(tiny_checkpoint_of("llama"), tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    scaled = load_model_config(folder).rope_inv_freq()
    plain = load_model_config(tiny_checkpoint_of("llama")).rope_inv_freq()
    np.testing.assert_allclose(scaled * 4, plain, rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "unsupported RoPE type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "missing"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_bad_config_is_a_clear_error(tiny_checkpoint_of, tmp_path, change, message):
    folder = copy_of(tiny_checkpoint_of("llama"), tmp_path)
    edit_config(folder, **change)
    with pytest.raises(CheckpointError, match=message) as info:
        core_of(folder)
    assert "config.json" in str(info.value)


def test_missing_or_corrupt_files_are_clear_errors(tiny_checkpoint_of, tmp_path):
    folder = copy_of(tiny_checkpoint_of("llama"), tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_model_config(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        load_model_config(folder)

    folder = copy_of(tiny_checkpoint_of("llama"), tmp_path / "b")
    cfg = load_model_config(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_params(folder, cfg)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_params(folder, cfg)


def test_missing_tensor_and_shard_are_named(tiny_checkpoint_of, tmp_path):
    folder = copy_of(tiny_checkpoint_of("llama", shards=2), tmp_path)
    cfg = load_model_config(folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'lm_head.weight' not found"):
        load_params(folder, cfg)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: file not found"):
        load_params(folder, cfg)


def test_tied_checkpoint_has_no_lm_head(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama_tied")
    params = load_params(folder, load_model_config(folder))
    assert "lm_head" not in params
