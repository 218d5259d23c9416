"""Tiny checkpoints as GGUF files, written the way llama.cpp's converter writes them.

Owns: turning a Hugging Face folder that engine.tiny wrote (config.json, safetensors,
tokenizer.json) into one GGUF file with the `gguf` package: llama.cpp's tensor names,
the query and key rows permuted for Llama, the tokenizer as `gpt2` BPE metadata
(tokens, types, merges, special ids, chat template), and every 2-D weight quantized to
a chosen type. For tests and benchmarks of GGUF loading; `arch` and `raw_types`
override what is written, to make files the server must refuse.

The `gguf` package quantizes the legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) but not the
K-quants; for those, blocks of random bits with small fixed scales are written, which
every GGUF reader dequantizes alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

# The byte offsets of each K-quant block's float16 scales (d, and dmin where it has one):
# ggml's block_q2_K .. block_q6_K.
_K_SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor."""
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a Llama query or key projection."""
    half = weight.shape[0] // heads // 2
    grouped = weight.reshape(heads, 2, half, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _quantized(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`values` as GGUF data of `qtype` (uint8 blocks, or the float arrays themselves)."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "F32":
        return values.astype(np.float32)
    if qtype == "F16":
        return values.astype(np.float16)
    if qtype in _K_SCALES:
        offsets = _K_SCALES[qtype]
        blocks = _random_blocks(values, qtype, rng)
        scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        for offset in offsets:
            blocks[:, offset : offset + 2] = scale
        return blocks.reshape(values.shape[0], -1)
    try:
        return quants.quantize(values.astype(np.float32), GGMLQuantizationType[qtype])
    except NotImplementedError:  # a type the package cannot quantize: random blocks
        return _random_blocks(values, qtype, rng).reshape(values.shape[0], -1)


def _random_blocks(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """(blocks, bytes a block) of random bits, as many blocks as `values` fills."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)


def _row_fits(values: np.ndarray, qtype: str) -> bool:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return values.ndim == 2 and values.shape[1] % block == 0


def write_gguf(
    folder: str | Path,
    out: str | Path,
    *,
    qtype: str = "F32",
    arch: str | None = None,
    raw_types: dict[str, str] | None = None,
    seed: int = 0,
) -> Path:
    """The tiny checkpoint in `folder` as GGUF file `out`: 2-D weights in `qtype` where
    their rows fit its blocks (float32 otherwise, and norms always), `raw_types` giving
    some tensors (by GGUF name) another type, `arch` another general.architecture."""
    import gguf

    folder, out = Path(folder), Path(out)
    config: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    hf_arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch or hf_arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, folder, config)
    rng = np.random.default_rng(seed)
    for name, values in load_file(str(folder / "model.safetensors")).items():
        values = values.astype(np.float32)
        if hf_arch == "llama" and ".q_proj." in name:
            values = permute_rows(values, heads)
        elif hf_arch == "llama" and ".k_proj." in name:
            values = permute_rows(values, kv_heads)
        target = gguf_name(name)
        kind = (raw_types or {}).get(target)
        if kind is None:
            kind = qtype if _row_fits(values, qtype) else "F32"
        data = _quantized(values, kind, rng)
        raw_dtype = gguf.GGMLQuantizationType[kind] if data.dtype == np.uint8 else None
        writer.add_tensor(target, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: Any, folder: Path, config: dict[str, Any]) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's `gpt2` tokenizer metadata."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab = vocab | special
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(True)
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])
