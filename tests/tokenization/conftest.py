"""Real tokenizers for the tokenization tests, trained here and saved like checkpoints.

Two styles, both with merges so characters really are split across tokens:
- byte-level BPE (Llama 3 style): every token is a byte string, BOS added on encode;
- SentencePiece-style BPE with byte fallback (Llama 2 style): `<0xXX>` byte tokens
  for characters outside a deliberately small alphabet, `▁` as the space marker,
  BOS added on encode and the leading space stripped on decode.
Plus GPT-2's real vocabulary from tests/fixtures/gpt2. Each folder is loaded back
through transformers' AutoTokenizer by `Tokenizer.from_folder`.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.trainers import BpeTrainer

from tokenization import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, café naïve résumé façade Ångström",
    "日本語のテキストです。中文文本测试。한국어 텍스트",
    "😀😃 👍🏽👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 emoji and 🇯🇵 flags",
    "שלום עולם مرحبا بالعالم",
    "STOP here. END of line\nnew line\ttab",
] * 20

# Characters the SentencePiece-style model learns; all others fall back to <0xXX> bytes.
# (An explicit alphabet, not limit_alphabet, whose ties make training nondeterministic.)
SPIECE_ALPHABET = frozenset(string.ascii_letters + string.digits + " .,!\n" + "éö日本語の文😀👍")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _save(rust: RustTokenizer, folder: Path, **special: str) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=rust, **special).save_pretrained(str(folder))
    return folder


def build_byte_level(folder: Path) -> Path:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|eot|>", "<|begin_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator(CORPUS, trainer)
    rust.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", 2)],
            ),
        ]
    )
    _save(rust, folder, eos_token="<|endoftext|>", bos_token="<|begin_of_text|>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eot = rust.token_to_id("<|eot|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eot]}))
    return folder


def build_sentencepiece(folder: Path) -> Path:
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_model = RustTokenizer(models.BPE(unk_token="<unk>"))
    trainer_model.normalizer = normalizer
    trainer = BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    corpus = ["".join(c for c in line if c in SPIECE_ALPHABET) for line in CORPUS]
    trainer_model.train_from_iterator(corpus, trainer)
    trained = json.loads(trainer_model.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    rust = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    rust.normalizer = normalizer
    rust.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    rust.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return _save(rust, folder, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_byte_level(tmp_path_factory.mktemp("byte-level"))


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "gpt2" / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def byte_level(byte_level_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(byte_level_dir)


@pytest.fixture(scope="session")
def sentencepiece(sentencepiece_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(sentencepiece_dir)


@pytest.fixture(scope="session")
def gpt2(gpt2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(gpt2_dir)


@pytest.fixture(scope="session", params=["byte_level", "sentencepiece", "gpt2"])
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def build_metaspace(folder: Path) -> Path:
    """A byte-free SentencePiece-style BPE (Metaspace decoder, <unk> for unknown characters)."""
    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    rust.train_from_iterator(
        ["".join(c for c in line if c in SPIECE_ALPHABET) for line in CORPUS], trainer
    )
    return _save(rust, folder, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_metaspace(tmp_path_factory.mktemp("metaspace")))


@pytest.fixture(scope="session")
def llama_class_dir(sentencepiece_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The byte-fallback checkpoint declared as a Llama tokenizer, as Llama 2 checkpoints are."""
    folder = tmp_path_factory.mktemp("llama-class")
    for item in sentencepiece_dir.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="LlamaTokenizerFast", add_bos_token=True, add_eos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
