"""The Llama 3 tokenizer rebuilt from a llama.cpp vocabulary GGUF, on a tiny synthetic GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")  # the `bench` extra

from bench.models import SHAPES, write_gguf_tokenizer  # noqa: E402

TOKENS = ["h", "e", "l", "o", "Ġ", "he", "ll", "hell", "hello", "Ġhello", "<|bos|>", "<|eos|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ hello"]


def write_vocab(path: Path, vectors: list[tuple[str, list[int]]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([1] * 10 + [3, 3])
    writer.add_bos_token_id(10)
    writer.add_eos_token_id(11)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_name(path.name + ".inp").write_text(
        "\n__ggml_vocab_test__\n".join(t for t, _ in vectors)
    )
    path.with_name(path.name + ".out").write_text(
        "\n".join(" " + " ".join(map(str, ids)) for _, ids in vectors)
    )
    return path


def test_tokenizer_from_gguf_encodes_like_the_vectors(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    vocab = write_vocab(tmp_path / "v.gguf", [("hello hello", [8, 9]), ("hell", [7])])
    out = tmp_path / "ckpt"
    out.mkdir()
    assert write_gguf_tokenizer(vocab, out, context=64) == {"bos": 10, "eos": 11}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hello hello").ids == [10, 8, 9]  # BOS added, as Llama 3's does
    assert tok.decode([8, 9]) == "hello hello"
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|bos|>", "<|eos|>")


def test_a_wrong_vector_fails_the_build(tmp_path: Path) -> None:
    vocab = write_vocab(tmp_path / "v.gguf", [("hello", [7])])
    with pytest.raises(ValueError, match="differs from llama.cpp"):
        write_gguf_tokenizer(vocab, tmp_path, context=64)


def test_shapes_have_the_sizes_they_are_named_for() -> None:
    assert SHAPES["70m-128k"].params() == 68_618_496
    assert SHAPES["70m-128k"].vocab == 128_256
    assert 100e6 < SHAPES["100m"].params() < 105e6


def test_a_prepared_gguf_as_safetensors_is_the_checkpoint_again(tmp_path: Path) -> None:
    """bench.models' float32 folder of a GGUF (the default model's, for peers): the weights
    of the checkpoint the GGUF was written from, whole or cut to its first layers."""
    import numpy as np

    from bench.models import gguf_as_safetensors
    from engine.checkpoint import load_params
    from engine.config import load_model_config
    from engine.gguf_folder import prepare_folder
    from engine.tiny import write_tiny_checkpoint
    from engine.tiny_gguf import write_gguf

    source = write_tiny_checkpoint(tmp_path / "hf", arch="llama")
    prepared = prepare_folder(write_gguf(source, tmp_path / "m.gguf"), tmp_path / "cache")
    whole = gguf_as_safetensors(prepared, tmp_path / "whole")
    config = load_model_config(source)
    want, got = load_params(source, config), load_params(whole, load_model_config(whole))
    for mine, theirs in zip(got["layers"], want["layers"], strict=True):
        assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
    assert np.array_equal(got["embed"], want["embed"])
    cut = gguf_as_safetensors(prepared, tmp_path / "cut", layers=1)
    assert load_model_config(cut).num_layers == 1
    assert (cut / "tokenizer.json").is_file() and not (cut / "gguf_tensors.json").exists()
