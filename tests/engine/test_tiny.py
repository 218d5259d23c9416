"""The tiny checkpoint writer: deterministic, loadable by transformers, a real BPE tokenizer."""

from __future__ import annotations

import json

import pytest

from engine.config import load_model_config
from engine.tiny import ARCHS, build_llama_checkpoint, main, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")


def test_same_seed_same_bytes(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", arch="qwen2", seed=3, shards=2)
    b = write_tiny_checkpoint(tmp_path / "b", arch="qwen2", seed=3, shards=2)
    c = write_tiny_checkpoint(tmp_path / "c", arch="qwen2", seed=4, shards=2)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } <= set(names)
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert (a / "model-00001-of-00002.safetensors").read_bytes() != (
        c / "model-00001-of-00002.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_has_the_tiny_shape(tiny_checkpoint_of, arch):
    cfg = load_model_config(tiny_checkpoint_of(arch))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (16, 128, 512)
    assert 400 <= cfg.vocab_size <= 512


def test_tokenizer_loads_with_autotokenizer(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert len(tokenizer) == load_model_config(folder).vocab_size
    text = "The quick brown fox, café 你好 😀"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges were learned
    pieces = [tokenizer.decode([i]) for i in tokenizer("😀", add_special_tokens=False)["input_ids"]]
    assert len(pieces) > 1 and "\ufffd" in "".join(pieces)  # a multi-byte char is split


def test_chat_template(tiny_checkpoint_of):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint_of("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("<|assistant|>\n")


def test_cli_and_bench_builder(tmp_path, capsys):
    main([str(tmp_path / "cli"), "--arch", "mistral"])
    assert str(tmp_path / "cli") in capsys.readouterr().out
    assert load_model_config(tmp_path / "cli").architecture == "MistralForCausalLM"
    folder = build_llama_checkpoint(tmp_path / "big", 32, 1, 2, 1, 64, 100)
    cfg = load_model_config(folder)
    assert (cfg.hidden_size, cfg.num_kv_heads, cfg.vocab_size) == (32, 1, 100)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 1
