"""Tokenizer: loading from a folder, ids, EOS/BOS, token bytes and the chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenization import ChatTemplateError, InvalidTokenError, TokenizationError, Tokenizer
from tokenization.byte_decoding import DecoderStyle

TEXTS = ["Hello world!", "日本語のテキスト", "héllo 👍🏽 👨‍👩‍👧‍👦", "שלום مرحبا", "a\tb\nc\x00d"]


def test_styles_and_special_ids(byte_level: Tokenizer, sentencepiece: Tokenizer, gpt2: Tokenizer):
    assert byte_level.style is DecoderStyle.BYTE_LEVEL
    assert gpt2.style is DecoderStyle.BYTE_LEVEL
    assert sentencepiece.style is DecoderStyle.BYTE_FALLBACK
    assert len(sentencepiece.byte_token_ids) == 256
    assert gpt2.special_token_ids == frozenset({50256})
    assert gpt2.vocab_size == 50257


def test_eos_from_generation_config_and_tokenizer(byte_level: Tokenizer, gpt2: Tokenizer):
    eot = byte_level.hf.convert_tokens_to_ids("<|eot|>")
    assert byte_level.eos_token_ids == frozenset({0, eot})
    assert gpt2.eos_token_ids == frozenset({50256})


def test_eos_single_int_generation_config(sentencepiece_dir: Path, tmp_path: Path):
    folder = tmp_path / "ckpt"
    shutil.copytree(sentencepiece_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_folder(folder).eos_token_ids == frozenset({2, 7})


def test_encode_adds_bos_as_the_model_expects(
    sentencepiece: Tokenizer, byte_level: Tokenizer, gpt2: Tokenizer
):
    assert byte_level.bos_token_id == 2
    assert (
        byte_level.encode("Hi")[0] == 2
        and byte_level.encode("Hi", add_special_tokens=False)[0] != 2
    )
    assert byte_level.decode(byte_level.encode("Hi")) == "Hi"
    ids = sentencepiece.encode("Hello")
    assert sentencepiece.bos_token_id == 1
    assert ids[0] == 1 and ids.count(1) == 1
    assert sentencepiece.encode("Hello", add_special_tokens=False) == ids[1:]
    assert gpt2.encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(any_tokenizer: Tokenizer, text: str):
    ids = any_tokenizer.encode(text)
    assert ids == any_tokenizer.hf.encode(text)
    assert any_tokenizer.decode(ids) == text


def test_characters_are_split_across_tokens(any_tokenizer: Tokenizer):
    """The fixtures must really cut multi-byte characters, or the detokenizer tests prove little."""
    ids = any_tokenizer.encode("日本語のテキスト 👨‍👩‍👧‍👦", add_special_tokens=False)
    partial = [i for i in ids if any_tokenizer.token_text(i).startswith("bytes:")]
    assert partial, [any_tokenizer.token_text(i) for i in ids]


def test_validate_ids(gpt2: Tokenizer):
    assert gpt2.validate_ids([0, 50256, 15496]) == [0, 50256, 15496]
    with pytest.raises(InvalidTokenError, match=r"50257 .*vocabulary size 50257"):
        gpt2.validate_ids([1, 50257])
    with pytest.raises(InvalidTokenError, match="-1"):
        gpt2.validate_ids([-1])
    with pytest.raises(InvalidTokenError, match="not an integer"):
        gpt2.validate_ids([1, "2"])  # type: ignore[list-item]
    with pytest.raises(InvalidTokenError, match="not an integer"):
        gpt2.validate_ids([True])
    with pytest.raises(InvalidTokenError, match="not an integer"):
        gpt2.validate_ids([1.0])  # type: ignore[list-item]
    assert issubclass(InvalidTokenError, ValueError)


def test_decode_skips_special_tokens(gpt2: Tokenizer):
    ids = [15496, 50256, 995]
    assert gpt2.decode(ids) == "Hello world"
    assert gpt2.decode(ids, skip_special_tokens=False) == "Hello<|endoftext|> world"


def test_token_text_and_bytes(gpt2: Tokenizer, sentencepiece: Tokenizer):
    assert gpt2.token_text(15496) == "Hello"
    assert gpt2.token_bytes(995) == b" world"
    assert gpt2.token_text(50256) == "<|endoftext|>"
    grin = gpt2.encode("😀")
    assert len(grin) == 2
    assert b"".join(gpt2.token_bytes(i) for i in grin) == "😀".encode()
    assert [gpt2.token_text(i) for i in grin] == [
        "bytes:" + "".join(f"\\x{b:02x}" for b in gpt2.token_bytes(i)) for i in grin
    ]
    byte_e2 = sentencepiece.hf.convert_tokens_to_ids("<0xE2>")
    assert sentencepiece.token_bytes(byte_e2) == b"\xe2"
    assert sentencepiece.token_text(byte_e2) == "bytes:\\xe2"
    space_hello = sentencepiece.encode(" Hello", add_special_tokens=False)
    assert b"".join(sentencepiece.token_bytes(i) for i in space_hello) == b"  Hello"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_text(gpt2: Tokenizer, byte_level: Tokenizer, text: str):
    for tok in (gpt2, byte_level):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_chat_template_from_checkpoint(byte_level: Tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    expected = (
        "<|begin_of_text|><|system|>Be brief.<|endoftext|><|user|>Hi 👋<|endoftext|><|assistant|>"
    )
    assert byte_level.has_chat_template
    assert byte_level.render_chat(messages) == expected
    ids = byte_level.apply_chat_template(messages)
    assert ids == byte_level.encode(expected, add_special_tokens=False)
    assert ids.count(0) == 2  # the template's EOS strings became special ids
    assert ids.count(2) == 1 and ids[0] == 2  # one BOS: the template's, none added on top
    no_prompt = byte_level.render_chat(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>")


def test_chat_content_parts_are_joined(gpt2: Tokenizer):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert gpt2.render_chat([{"role": "user", "content": parts}]) == "user: a\nb\nassistant: "
    with pytest.raises(ChatTemplateError, match="only text"):
        gpt2.render_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def test_bad_role_is_a_chat_template_error(byte_level: Tokenizer):
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        byte_level.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="role"):
        byte_level.apply_chat_template([{"content": "hi"}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        byte_level.apply_chat_template([])


def test_no_chat_template_is_a_clear_error(sentencepiece_dir: Path):
    tok = Tokenizer.from_folder(sentencepiece_dir)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_file_overrides(sentencepiece_dir: Path, byte_level_dir: Path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = Tokenizer.from_folder(sentencepiece_dir, chat_template=template)
    assert tok.has_chat_template
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    overridden = Tokenizer.from_folder(byte_level_dir, chat_template=template)
    assert overridden.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_missing_folder_or_tokenizer(tmp_path: Path):
    with pytest.raises(TokenizationError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizationError, match="cannot load"):
        Tokenizer.from_folder(tmp_path / "empty")


def test_corrupt_tokenizer_file(gpt2_dir: Path, tmp_path: Path):
    folder = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, folder)
    (folder / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(TokenizationError, match="cannot load"):
        Tokenizer.from_folder(folder)


def test_bad_generation_config(gpt2_dir: Path, tmp_path: Path):
    folder = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizationError, match="eos_token_id"):
        Tokenizer.from_folder(folder)
