"""GGUF checkpoints: tiny models written as llama.cpp writes them (engine.tiny_gguf), read
back through a prepared folder (engine.gguf_folder) against the Hugging Face folder they
came from, against transformers loading the same GGUF, and refused with a clear error when
they cannot be served."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.gguf import GGUFFile, unpermute_rows
from engine.gguf_folder import prepare_folder
from engine.tiny_gguf import permute_rows, write_gguf
from engine.types import CheckpointError

pytest.importorskip("gguf")
LEGACY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# rows of 256, the K-quants' block
K_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def gguf_of(folder: Path, tmp_path: Path, **options: object) -> tuple[Path, Path]:
    """(the GGUF file of a tiny folder, its prepared folder)."""
    file = write_gguf(folder, tmp_path / "model.gguf", **options)  # type: ignore[arg-type]
    return file, prepare_folder(file, tmp_path / "cache")


def test_the_permutation_is_undone() -> None:
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(rows, 2), 2), rows)
    assert not np.array_equal(permute_rows(rows, 2), rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_tied"])
def test_a_float32_gguf_gives_the_checkpoints_config_and_bits(arch, tiny_checkpoint_of, tmp_path):
    folder = tiny_checkpoint_of(arch)
    _, prepared = gguf_of(folder, tmp_path)
    config = load_model_config(folder)
    assert load_model_config(prepared) == config
    want, got = load_params(folder, config), load_params(prepared, config)
    assert set(got) == set(want) and len(got["layers"]) == len(want["layers"])
    for name in want:
        if name != "layers":
            assert np.array_equal(got[name], want[name]), name
    for mine, theirs in zip(got["layers"], want["layers"], strict=True):
        assert set(mine) == set(theirs)
        for name in theirs:
            assert np.array_equal(mine[name], theirs[name]), name


def _hf_state(gguf_file: Path) -> dict[str, np.ndarray]:
    """transformers' own reading of the GGUF: its model's float32 state dict."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _check_against_transformers(file: Path, prepared: Path) -> None:
    config = load_model_config(prepared)
    mine, theirs = load_params(prepared, config), _hf_state(file)
    d = config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    np.testing.assert_array_equal(mine["embed"], theirs["model.embed_tokens.weight"])
    np.testing.assert_array_equal(mine["final_norm"], theirs["model.norm.weight"])
    if "lm_head" in mine:
        np.testing.assert_array_equal(mine["lm_head"], theirs["lm_head.weight"])
    for i, layer in enumerate(mine["layers"]):
        p = f"model.layers.{i}."
        wqkv = layer["wqkv"]
        np.testing.assert_array_equal(wqkv[:q], theirs[p + "self_attn.q_proj.weight"])
        np.testing.assert_array_equal(wqkv[q : q + kv], theirs[p + "self_attn.k_proj.weight"])
        np.testing.assert_array_equal(wqkv[q + kv :], theirs[p + "self_attn.v_proj.weight"])
        np.testing.assert_array_equal(layer["wo"], theirs[p + "self_attn.o_proj.weight"])
        gate_up = np.concatenate(
            [theirs[p + "mlp.gate_proj.weight"], theirs[p + "mlp.up_proj.weight"]]
        )
        np.testing.assert_array_equal(layer["w_gate_up"], gate_up)
        np.testing.assert_array_equal(layer["w_down"], theirs[p + "mlp.down_proj.weight"])
        np.testing.assert_array_equal(layer["attn_norm"], theirs[p + "input_layernorm.weight"])


@pytest.mark.parametrize("qtype", LEGACY_TYPES[1:])
def test_quantized_tensors_dequantize_as_transformers_reads_them(
    qtype, tiny_checkpoint_of, tmp_path
):
    file, prepared = gguf_of(tiny_checkpoint_of("llama"), tmp_path, qtype=qtype)
    kinds = {t.tensor_type.name for t in GGUFFile(file)._reader.tensors}
    assert qtype in kinds
    _check_against_transformers(file, prepared)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_dequantize_as_transformers_reads_them(qtype, tiny_checkpoint_of, tmp_path):
    file, prepared = gguf_of(tiny_checkpoint_of("llama", **K_SHAPE), tmp_path, qtype=qtype)
    _check_against_transformers(file, prepared)


def test_logits_match_transformers_on_a_quantized_gguf(tiny_checkpoint_of, tmp_path):
    """The engine's prompt logprobs over the prepared folder against transformers' model
    loaded from the same Q8_0 file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.core.scheduler import SequenceState
    from engine.types import SamplingParams
    from tests.engine.conftest import core_of, run_core

    file, prepared = gguf_of(tiny_checkpoint_of("llama"), tmp_path, qtype="Q8_0")
    prompt = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223, 163, 124, 257, 502, 315, 249]
    seq = SequenceState(
        "p", tuple(prompt), SamplingParams(temperature=0.0, seed=0), 1, prompt_logprobs=1
    )
    events = run_core(core_of(prepared), [seq])["p"]
    entries = events[0].prompt_logprobs
    assert entries is not None
    got = np.array([e.logprob for e in entries[1:]])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    want = torch.log_softmax(logits, dim=-1).numpy()
    np.testing.assert_allclose(
        got, [want[p - 1, prompt[p]] for p in range(1, len(prompt))], atol=1e-4
    )


def test_the_tokenizer_gives_transformers_gguf_ids(tiny_checkpoint_of, tmp_path):
    from transformers import AutoTokenizer

    from tokenization import Tokenizer

    file, prepared = gguf_of(tiny_checkpoint_of("llama"), tmp_path)
    ours = Tokenizer.from_folder(prepared)
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for text in ("Hello there, the quick brown fox.", "<|eot|> ids\n\n  spaced", "émoji 🙂 ok"):
        assert ours.hf(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.hf.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert ours.eos_token_ids == {load_model_config(prepared).eos_token_ids[0]}


def test_a_prepared_folder_is_reused_until_the_file_changes(tiny_checkpoint_of, tmp_path):
    file, prepared = gguf_of(tiny_checkpoint_of("llama"), tmp_path)
    assert prepare_folder(file, tmp_path / "cache") == prepared
    write_gguf(tiny_checkpoint_of("llama"), file, qtype="Q8_0")
    assert prepare_folder(file, tmp_path / "cache") != prepared


def test_an_unknown_tensor_type_is_refused_by_name(tiny_checkpoint_of, tmp_path):
    file = write_gguf(
        tiny_checkpoint_of("llama"),
        tmp_path / "m.gguf",
        raw_types={"blk.0.ffn_up.weight": "IQ4_NL"},
    )
    with pytest.raises(CheckpointError, match="'blk.0.ffn_up.weight' has type IQ4_NL"):
        prepare_folder(file, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*")), "nothing is left half written"


def test_a_truncated_file_is_refused(tiny_checkpoint_of, tmp_path):
    file = write_gguf(tiny_checkpoint_of("llama"), tmp_path / "m.gguf")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated|not a readable GGUF"):
        prepare_folder(file, tmp_path / "cache")
    file.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        prepare_folder(file, tmp_path / "cache")


def test_an_architecture_the_engine_does_not_serve_is_refused(tiny_checkpoint_of, tmp_path):
    file = write_gguf(tiny_checkpoint_of("llama"), tmp_path / "m.gguf", arch="gemma")
    with pytest.raises(CheckpointError, match="unsupported architecture 'gemma'"):
        prepare_folder(file, tmp_path / "cache")
