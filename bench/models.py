"""Benchmark checkpoints: random Llama weights of set shapes, with a real tokenizer.

Run: `python -m bench.models NAME OUT_DIR [--sdist FILE.tar.gz | --vocab-gguf FILE]`.

  tiny      the tiny test checkpoint (engine.tiny), 512-token vocabulary
  100m      ~102M params: hidden 768, 10 layers, GPT-2's 50,257-token vocabulary
            (tied), the GPT-2 tokenizer bundled with the tests; the shape of
            bench.orchestrator_bench
  smollm2-135m  the default model (SmolLM2-135M-Instruct, engine.model_source): its
            GGUF dequantized to a float32 safetensors folder with its tokenizer, the
            same weights for our server and peers that do not read GGUF alike
  70m-128k  ~68.6M params: hidden 256, 4 layers, Llama 3's 128,256-token
            vocabulary (untied), float32; its tokenizer is Llama 3's byte-level
            BPE rebuilt from the vocabulary GGUF that llama.cpp ships in its
            source (`vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf` inside the
            llama-cpp-python sdist). Without --sdist/--vocab-gguf the sdist is got
            with `pip download --no-deps --no-binary llama-cpp-python`. The result
            is checked against the test vectors shipped beside the GGUF.

Owns: which shapes the serving benchmark names, and the GGUF -> tokenizer.json
conversion. Needs the `gguf` package (the `bench` extra) for 70m-128k only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.tiny import build_llama_checkpoint, write_tiny_checkpoint

GPT2_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpt2"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VOCAB_MEMBER = "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"
# Llama 3's pre-tokenizer split, as in its tokenizer.json and llama.cpp's "llama-bpe".
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_CONTROL = 3  # llama.cpp token type of special tokens


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    def params(self) -> int:
        h, d = self.hidden, self.hidden // self.heads
        attn = 2 * h * self.heads * d + 2 * h * self.kv_heads * d
        per_layer = attn + 3 * h * self.intermediate + 2 * h
        embed = self.vocab * h * (1 if self.tied else 2)
        return self.layers * per_layer + embed + h


SHAPES = {
    "100m": Shape(768, 10, 12, 4, 2048, 50257, tied=True),
    "70m-128k": Shape(256, 4, 4, 2, 704, 128256, tied=False),
}
MODELS = ("tiny", "smollm2-135m", *SHAPES)
REAL = "smollm2-135m"


def build(name: str, folder: Path, *, context: int = 1024, vocab_gguf: Path | None = None) -> Path:
    """Write checkpoint `name` (one of MODELS) with its tokenizer into `folder`."""
    folder = Path(folder)
    if name == "tiny":
        return write_tiny_checkpoint(folder, arch="llama", seed=0)
    if name == REAL:
        return default_model_folder(folder)
    if name not in SHAPES:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    shape = SHAPES[name]
    build_llama_checkpoint(
        folder, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate,
        shape.vocab, max_position_embeddings=context, tie_word_embeddings=shape.tied,
    )  # fmt: skip
    if name == "100m":
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(GPT2_TOKENIZER / file, folder / file)
        _set_special_ids(folder, bos=50256, eos=50256)
        return folder
    if vocab_gguf is None:
        raise ValueError("70m-128k needs the Llama 3 vocabulary GGUF (--vocab-gguf or --sdist)")
    ids = write_gguf_tokenizer(vocab_gguf, folder, context)
    _set_special_ids(folder, bos=ids["bos"], eos=ids["eos"])
    return folder


def default_model_folder(folder: Path, cache_dir: Path | None = None) -> Path:
    """The default model as a float32 safetensors checkpoint folder."""
    from engine.gguf_folder import prepare_folder
    from engine.model_source import fetch_default

    cache = cache_dir or Path.home() / ".cache" / "jax-llm-server"
    return gguf_as_safetensors(prepare_folder(fetch_default(cache), cache / "gguf"), folder)


def gguf_as_safetensors(prepared: Path, into: Path, layers: int | None = None) -> Path:
    """A prepared GGUF folder (engine.gguf_folder) as a float32 safetensors folder: its
    first `layers` layers (all by default) with the embedding, final norm and head, its
    config and tokenizer files."""
    import re

    import numpy as np
    from safetensors.numpy import save_file

    from engine.gguf import INDEX_FILE, TensorLoader

    loader = TensorLoader.open(prepared)
    config = json.loads((prepared / "config.json").read_text(encoding="utf-8"))
    layers = config["num_hidden_layers"] if layers is None else layers
    keep = {
        name: np.ascontiguousarray(loader.get(name))
        for name in loader.index
        if not (m := re.match(r"model\.layers\.(\d+)\.", name)) or int(m.group(1)) < layers
    }
    into.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(into / "model.safetensors"))
    (into / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    for extra in prepared.iterdir():  # tokenizer files, generation config, chat template
        if extra.suffix in (".json", ".jinja") and extra.name not in ("config.json", INDEX_FILE):
            shutil.copy(extra, into / extra.name)
    return into


def _set_special_ids(folder: Path, bos: int, eos: int) -> None:
    for file in ("config.json", "generation_config.json"):
        path = folder / file
        data = json.loads(path.read_text(encoding="utf-8"))
        data |= {"bos_token_id": bos, "eos_token_id": eos}
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_gguf_vocab(path: Path) -> dict[str, Any]:
    """Tokens, merges, token types and bos/eos ids of a llama.cpp BPE vocabulary GGUF."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        if key not in fields:
            raise ValueError(f"{path}: no {key} (not a llama.cpp vocabulary GGUF?)")
        return fields[key].contents()

    model = value("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {model!r}; only BPE ('gpt2') is built")
    return {
        "pre": value("tokenizer.ggml.pre"),
        "tokens": value("tokenizer.ggml.tokens"),
        "types": value("tokenizer.ggml.token_type"),
        "merges": value("tokenizer.ggml.merges"),
        "bos": int(value("tokenizer.ggml.bos_token_id")),
        "eos": int(value("tokenizer.ggml.eos_token_id")),
    }


def tokenizer_from_vocab(vocab: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equal to Llama 3's tokenizer.json for a llama-bpe vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    if vocab["pre"] != "llama-bpe":
        raise ValueError(f"pre-tokenizer {vocab['pre']!r}: only llama-bpe (Llama 3) is built")
    tokens = vocab["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)}, merges, ignore_merges=True, fuse_unk=False
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, vocab["types"], strict=True)
        if kind == GGUF_CONTROL
    ]
    tok.add_special_tokens(special)
    bos = tokens[vocab["bos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, vocab["bos"])],
    )
    return tok


def write_gguf_tokenizer(gguf_path: Path, folder: Path, context: int) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json from the GGUF, checked on its test vectors."""
    vocab = read_gguf_vocab(gguf_path)
    tok = tokenizer_from_vocab(vocab)
    check_vectors(tok, gguf_path)
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = vocab["tokens"][vocab["bos"]], vocab["tokens"][vocab["eos"]]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": True,
        "model_max_length": context,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"bos": vocab["bos"], "eos": vocab["eos"]}


def check_vectors(tok: Any, gguf_path: Path) -> int:
    """Encode llama.cpp's test inputs (FILE.inp) and compare with FILE.out; raise on a miss.

    Returns how many vectors were checked (0 when the files are absent).
    """
    inp, out = Path(f"{gguf_path}.inp"), Path(f"{gguf_path}.out")
    if not (inp.is_file() and out.is_file()):
        return 0
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = out.read_text(encoding="utf-8").split("\n")
    for text, want in zip(texts, expected, strict=False):
        got = tok.encode(text, add_special_tokens=False).ids
        if got != [int(x) for x in want.split()]:
            raise ValueError(f"tokenizer differs from llama.cpp's vector for {text!r}: {got}")
    return len(texts)


def vocab_from_sdist(sdist: Path, into: Path) -> Path:
    """Extract the Llama 3 vocabulary GGUF and its test vectors from the llama-cpp-python sdist."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if name.startswith(VOCAB_MEMBER):
                member.name = Path(name).name
                tar.extract(member, into, filter="data")
    path = into / Path(VOCAB_MEMBER).name
    if not path.is_file():
        raise ValueError(f"{sdist} holds no {VOCAB_MEMBER}")
    return path


def download_sdist(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
    subprocess.run([*cmd, LLAMA_CPP_SDIST, "-d", str(into)], check=True)
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--context", type=int, default=1024, help="max_position_embeddings")
    parser.add_argument("--sdist", type=Path, help="llama-cpp-python sdist (.tar.gz)")
    parser.add_argument("--vocab-gguf", type=Path, help="ggml-vocab-llama-bpe.gguf")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = args.vocab_gguf
        if args.model == "70m-128k" and gguf_path is None:
            sdist = args.sdist or download_sdist(Path(tmp))
            gguf_path = vocab_from_sdist(sdist, Path(tmp))
        path = build(args.model, args.out_dir, context=args.context, vocab_gguf=gguf_path)
    if args.model in SHAPES:
        print(f"{path}: {SHAPES[args.model].params() / 1e6:.1f}M params")
    else:
        print(path)


if __name__ == "__main__":
    main()
