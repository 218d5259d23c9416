"""GGUF checkpoints (llama.cpp's single-file format) as a model source.

Owns: reading one GGUF file with the `gguf` package: its metadata turned into the
config.json / generation_config.json a Hugging Face folder would have, and its tensors
dequantized to float32 under Hugging Face's names, with llama.cpp's row permutation of
the query and key projections undone. Receives a file path; emits dicts and numpy
arrays. Anything it cannot serve faithfully (an architecture, a tensor type, RoPE
frequency factors, a truncated file) is a `CheckpointError` naming the file and the
problem.

`prepare_folder` (engine.gguf_folder) writes these, and an index of the tensors' bytes,
next to a link to the file once, so the rest of the engine reads a GGUF like any
checkpoint folder; `TensorLoader` dequantizes from that index at every load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.types import CheckpointError

INDEX_FILE = "gguf_tensors.json"  # in a prepared folder: where each tensor's bytes lie
# general.architecture -> the Hugging Face class the engine serves it as (Mistral's GGUFs
# say "llama": llama.cpp converts them as Llama).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Tensor types dequantized at load (the gguf package's numpy dequantizers).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for one the engine does not read."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a query or key projection's rows (or bias).

    Its converter regroups each head's rows from rotate-half order (first halves, then
    second halves) into interleaved pairs for GGML's RoPE; this is the inverse."""
    half = weight.shape[0] // heads // 2
    grouped = weight.reshape(heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


class GGUFFile:
    """One GGUF file's metadata and tensors, read with the `gguf` package's reader."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: file not found")
        try:
            self._reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, KeyError, IndexError, ...
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.arch = str(self.field("general.architecture", ""))
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_sizes()

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (a number, a string or a list), `default` when absent."""
        found = self._reader.get_field(key)
        if found is None:
            return default
        return found.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_field(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def _check_sizes(self) -> None:
        """Every tensor's bytes lie inside the file, and its type is one we dequantize."""
        size = self.path.stat().st_size
        for tensor in self._reader.tensors:
            kind = tensor.tensor_type.name
            if hf_name(tensor.name) is not None and kind not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name!r} has type {kind}, which this server "
                    f"does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})"
                )
            if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes < tensor.n_bytes:
                raise CheckpointError(
                    f"{self.path}: truncated file: tensor {tensor.name!r} ends at byte "
                    f"{tensor.data_offset + tensor.n_bytes}, the file has {size}"
                )

    def hf_config(self) -> dict[str, Any]:
        """config.json of the equivalent Hugging Face checkpoint."""
        arch = ARCHITECTURES.get(self.arch)
        if arch is None:
            raise CheckpointError(
                f"{self.path}: unsupported architecture {self.arch!r} "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        if self._arch_field("expert_count", 0):
            raise CheckpointError(f"{self.path}: mixture-of-experts models are not supported")
        if "rope_freqs.weight" in self._tensors:
            raise CheckpointError(
                f"{self.path}: RoPE frequency factors (tensor rope_freqs.weight) are not supported"
            )
        hidden = int(self._required("embedding_length"))
        heads = int(self._required("attention.head_count"))
        head_dim = int(self._arch_field("attention.key_length") or hidden // heads)
        rope_dims = int(self._arch_field("rope.dimension_count") or head_dim)
        if rope_dims != head_dim:
            raise CheckpointError(
                f"{self.path}: partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported"
            )
        tokens = self.field("tokenizer.ggml.tokens")
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.arch,
            "vocab_size": int(self._arch_field("vocab_size") or len(tokens or ())),
            "hidden_size": hidden,
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "intermediate_size": int(self._required("feed_forward_length")),
            # stored as float32: its shortest decimal (1e-05, not 9.99999974e-06)
            "rms_norm_eps": float(
                str(np.float32(self._required("attention.layer_norm_rms_epsilon")))
            ),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
            "attention_bias": self.arch == "llama" and "blk.0.attn_q.bias" in self._tensors,
        }
        if config["vocab_size"] < 1:
            raise CheckpointError(f"{self.path}: metadata gives no vocabulary size")
        scaling = self._arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise CheckpointError(f"{self.path}: RoPE scaling {scaling!r} is not supported")
            factor = float(self._required("rope.scaling.factor"))
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        window = self._arch_field("attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
        for key in ("bos", "eos"):
            value = self.field(f"tokenizer.ggml.{key}_token_id")
            if value is not None:
                config[f"{key}_token_id"] = int(value)
        return config

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json: the ids that end generation (EOS, and EOT when set)."""
        ends = [
            int(v)
            for v in (
                self.field("tokenizer.ggml.eos_token_id"),
                self.field("tokenizer.ggml.eot_token_id"),
            )
            if v is not None
        ]
        out: dict[str, Any] = {}
        if ends:
            out["eos_token_id"] = ends[0] if len(set(ends)) == 1 else sorted(set(ends))
        bos = self.field("tokenizer.ggml.bos_token_id")
        if bos is not None:
            out["bos_token_id"] = int(bos)
        return out

    def write_index(self, folder: Path, link: str) -> None:
        """The index `TensorLoader.open` reads: every tensor's bytes in the file `link`."""
        config = self.hf_config()
        data = {
            "file": link,
            "arch": self.arch,
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "tensors": {
                hf: [i.name, i.kind, list(i.shape), i.offset, i.nbytes]
                for hf, i in self.tensor_index().items()
            },
        }
        (folder / INDEX_FILE).write_text(json.dumps(data), encoding="utf-8")

    def tensor_index(self) -> dict[str, TensorInfo]:
        """Hugging Face name -> where its bytes lie, for every tensor the engine reads."""
        index = {}
        for tensor in self._reader.tensors:
            hf = hf_name(tensor.name)
            if hf is not None:
                shape = tuple(int(n) for n in reversed(tensor.shape))
                info = TensorInfo(
                    tensor.name, tensor.tensor_type.name, shape, tensor.data_offset, tensor.n_bytes
                )
                index[hf] = info
        return index


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name there, type, shape in Hugging Face's (out, in)
    order, and the span of its bytes in the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class TensorLoader:
    """Tensors of a GGUF file dequantized to float32 from an index of their bytes, without
    parsing the file again (its header, whose vocabulary alone is ~100k fields, took ~3 s
    of the gguf package's reader per load of SmolLM2-135M)."""

    def __init__(
        self, file: Path, index: dict[str, TensorInfo], arch: str, heads: int, kv_heads: int
    ):
        self.file = file
        self.index = index
        self._bytes = np.memmap(file, np.uint8, mode="r")
        self._permuted = {"attn_q": heads, "attn_k": kv_heads} if arch == "llama" else {}

    @classmethod
    def open(cls, folder: Path) -> TensorLoader:
        """The loader of a prepared folder (engine.gguf_folder): its index and GGUF link."""
        data = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
        index = {
            hf: TensorInfo(name, kind, tuple(shape), offset, nbytes)
            for hf, (name, kind, shape, offset, nbytes) in data["tensors"].items()
        }
        return cls(folder / data["file"], index, data["arch"], data["heads"], data["kv_heads"])

    def get(self, hf: str) -> np.ndarray:
        """A tensor dequantized to float32, in Hugging Face's (out, in) layout, with the
        query and key rows in Hugging Face's order (llama.cpp permutes them for Llama)."""
        from gguf import GGMLQuantizationType, quants

        info = self.index[hf]
        rows = int(np.prod(info.shape[:-1]))
        raw = self._bytes[info.offset : info.offset + info.nbytes]
        if raw.size != info.nbytes:
            raise CheckpointError(f"{self.file}: truncated at tensor {info.name!r}")
        try:
            values = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType[info.kind])
        except Exception as exc:  # a malformed block raises whatever numpy raises
            raise CheckpointError(f"{self.file}: cannot dequantize {info.name!r} ({exc})") from exc
        values = np.asarray(values, dtype=np.float32).reshape(info.shape)
        heads = self._permuted.get(info.name.split(".")[-2])
        return values if heads is None else unpermute_rows(values, heads)
