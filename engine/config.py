"""Model configuration read from a Hugging Face checkpoint folder.

Owns: turning config.json / generation_config.json into a frozen, validated
`ModelConfig`, and the RoPE inverse frequencies that config implies. Anything
the model code cannot run faithfully is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.types import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder; hashable so jit can close over it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_params: tuple[tuple[str, float], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Tensor parallelism (see `tensor_parallel`): fused q/k/v and gate/up weights hold
    # `shards` groups of columns, one per device; num_kv_heads counts each kv head
    # `kv_replicas` times when there are fewer kv heads than devices (vLLM's way).
    shards: int = 1
    kv_replicas: int = 1
    # Norms and prompt logprobs sum a row as a fixed tree of adds (engine.rowwise): the
    # same bits in any batch. False where the backend's own reduce is used instead (TPU,
    # where each level of the tree is a pass over memory; engine.core.core decides).
    fixed_order_sums: bool = True
    # RoPE's rotate-half as a product with a signed permutation (exact: one nonzero term
    # per output) instead of two half-width slices: TPU pads each 64-lane half to 128.
    rope_by_product: bool = False
    # The step's layers as one compiled loop (lax.scan), or unrolled: a loop compiles and
    # loads in a fraction of the time; TPU unrolls, where each layer's cost is counted
    # (compiled programs' cost analysis counts a loop's body once) and XLA schedules
    # across layers (engine.core.core decides).
    scan_layers: bool = True
    # The row-parallel products (wo, w_down) leave each device in the model's dtype, so
    # tensor parallelism's all-reduce sums rounded partials (vLLM's and tpu-inference's
    # form) instead of writing and reading float32 ones: TPU, where each is a pass over
    # HBM (engine.core.core decides). With one device both forms round the same sum.
    partials_in_dtype: bool = False
    # The layer and head products of float32 rows through engine.row_dot's kernel: a row
    # gets the same bits at any row count, in one pass over the weights at a few rows
    # (XLA:CPU with one device and the kernel built; engine.core.core decides).
    row_products: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def head_shards(self) -> int:
        """Devices the vocabulary head is split over (1: a copy on each)."""
        return self.shards if self.vocab_size % self.shards == 0 else 1

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies (head_dim // 2,) float32, computed as transformers does."""
        exponent = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32)
        inv_freq = (1.0 / (np.float32(self.rope_theta) ** (exponent / self.head_dim))).astype(
            np.float32
        )
        params = dict(self.rope_params)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(params["factor"])).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, params)
        return inv_freq


def tensor_parallel(config: ModelConfig, size: int) -> ModelConfig:
    """`config` laid out over `size` devices: heads, kv heads and the MLP split evenly.

    kv heads fewer than devices are replicated, each device keeping a copy of the
    one its query heads read (size must then be a multiple of them). A split that
    cannot be even is a ValueError naming the dimension.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.shards != 1:
        raise ValueError("the config is already laid out for tensor parallelism")
    problems = [
        f"{name} {value}"
        for name, value in (
            ("num_attention_heads", config.num_heads),
            ("intermediate_size", config.intermediate_size),
        )
        if value % size
    ]
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} (neither divides the other)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's " + ", ".join(problems)
        )
    replicas = max(1, size // kv)
    return dataclasses.replace(
        config, shards=size, kv_replicas=replicas, num_kv_heads=kv * replicas
    )


def _llama3_inv_freq(inv_freq: np.ndarray, params: dict[str, float]) -> np.ndarray:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError saying which file is bad and how."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _require(raw: dict[str, Any], key: str, path: Path) -> Any:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{path}: missing required field {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """RoPE theta/type/params from either transformers 5 `rope_parameters` or older fields."""
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{path}: rope parameters must be an object, got {scaling!r}")
    theta = float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: unsupported RoPE type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})"
        )
    needed = {
        "default": (),
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }[rope_type]
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise CheckpointError(f"{path}: RoPE type {rope_type!r} is missing {missing}")
    return theta, rope_type, tuple((k, float(scaling[k])) for k in needed)


def _eos_ids(*values: Any) -> tuple[int, ...]:
    for value in values:
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return tuple(sorted({int(i) for i in ids}))
    return ()


def load_model_config(folder: str | Path) -> ModelConfig:
    """Parse config.json (and generation_config.json when present) of a checkpoint folder."""
    folder = Path(folder)
    path = folder / "config.json"
    raw = read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: unsupported architecture {archs!r} (supported: {SUPPORTED_ARCHITECTURES})"
        )
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported")
    sliding_window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{path}: Qwen2 use_sliding_window=true is not supported")
        sliding_window = None
    elif arch == "LlamaForCausalLM":
        sliding_window = None
    hidden = int(_require(raw, "hidden_size", path))
    heads = int(_require(raw, "num_attention_heads", path))
    theta, rope_type, rope_params = _rope(raw, path)
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    attention_bias = bool(raw.get("attention_bias", False))
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers", path)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_params=rope_params,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        sliding_window=int(sliding_window) if sliding_window else None,
        eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id")),
        bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
    )
    if config.num_heads % config.num_kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {config.num_kv_heads}"
        )
    return config
