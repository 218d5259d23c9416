"""Tiny random checkpoints of every supported architecture, for tests and benchmarks.

Owns: writing a Hugging Face style folder (config.json, generation_config.json,
safetensors weights, tokenizer.json, tokenizer_config.json) that both this
engine and transformers load. Deterministic: the same arguments give the same
bytes. Run `python -m engine.tiny OUT_DIR --arch llama` to write one by hand.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from engine.tiny_corpus import CORPUS

ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "llama_tied")
BOS, EOS, EOT = "<s>", "</s>", "<|eot|>"
SPECIAL_TOKENS = (BOS, EOS, EOT)
TOKENIZER_VOCAB = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer (with merges) trained on the built-in corpus, as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer.to_str(pretty=True)


def _write_tokenizer(folder: Path, max_len: int) -> dict[str, int]:
    text = tokenizer_json()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    vocab = json.loads(text)["model"]["vocab"]
    ids = {"vocab_size": len(vocab), "bos": vocab[BOS], "eos": vocab[EOS], "eot": vocab[EOT]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    return ids


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _arch_config(arch: str, eos: int, eot: int) -> dict[str, Any]:
    """config.json fields that differ between the tiny variants."""
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    if arch == "llama3_rope":
        base.pop("rope_parameters")
        base["rope_theta"] = 500000.0
        base["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        base["eos_token_id"] = [eos, eot]
    elif arch == "mistral":
        base |= {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": 16,
        }
    elif arch == "qwen2":
        base |= {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": None,
        }
    elif arch == "llama_tied":
        base["tie_word_embeddings"] = True
    elif arch != "llama":
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return base


def random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """float32 weights named as transformers names them, scaled so logits are well spread."""
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    bias = config["model_type"] == "qwen2"

    def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    def linear(out: int, inp: int) -> np.ndarray:
        return normal(out, inp, scale=inp**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal(h, scale=0.1)).astype(np.float32)

    # Tied embeddings double as the output head: keep them small so logits stay spread.
    embed_scale = h**-0.5 if config["tie_word_embeddings"] else 1.0
    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], h, scale=embed_scale)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        }
        if bias:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                weights[p + f"self_attn.{name}.bias"] = normal(size, scale=0.1)
    weights["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(config["vocab_size"], h)
    return weights


def write_weights(
    folder: Path, weights: dict[str, np.ndarray], dtype: str = "float32", shards: int = 1
) -> None:
    """model.safetensors, or `shards` files plus model.safetensors.index.json."""
    cast: Callable[[np.ndarray], np.ndarray] = (
        (lambda a: a.astype(ml_dtypes.bfloat16)) if dtype == "bfloat16" else (lambda a: a)
    )
    weights = {name: cast(a) for name, a in weights.items()}
    metadata = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(folder / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    groups = [names[i::shards] for i in range(shards)]
    weight_map: dict[str, str] = {}
    for n, group in enumerate(groups, start=1):
        file = f"model-{n:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k] for k in group}, str(folder / file), metadata=metadata)
        weight_map |= {k: file for k in group}
    total = sum(a.nbytes for a in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(folder / "model.safetensors.index.json", index)


def _finish_folder(
    folder: Path,
    config: dict[str, Any],
    seed: int,
    dtype: str,
    shards: int,
    bos: int,
    eos: int | list[int],
) -> Path:
    config = {"dtype": dtype, "torch_dtype": dtype, "hidden_act": "silu"} | config
    _write_json(folder / "config.json", config)
    generation = {"bos_token_id": bos, "eos_token_id": config.get("eos_token_id", eos)}
    _write_json(folder / "generation_config.json", generation)
    write_weights(folder, random_weights(config, seed), dtype, shards)
    return folder


def write_tiny_checkpoint(
    folder: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` (one of ARCHS) with its tokenizer into `folder`."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(folder, TINY_SHAPE["max_position_embeddings"])
    config: dict[str, Any] = {
        **TINY_SHAPE,
        "vocab_size": ids["vocab_size"],
        "rms_norm_eps": 1e-5,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "attention_bias": False,
    }
    config |= _arch_config(arch, ids["eos"], ids["eot"])
    config |= config_overrides
    return _finish_folder(folder, config, seed, dtype, shards, ids["bos"], ids["eos"])


def build_llama_checkpoint(
    folder: str | Path,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    shards: int = 1,
) -> Path:
    """A random Llama-shaped checkpoint of any size (benchmarks); token ids 0/1 are bos/eos."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    return _finish_folder(folder, config, seed, dtype, shards, 0, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(
        args.out_dir, arch=args.arch, seed=args.seed, dtype=args.dtype, shards=args.shards
    )
    print(path)


if __name__ == "__main__":
    main()
