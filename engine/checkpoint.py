"""Weights read from *.safetensors (one file or sharded with an index), or from one GGUF
file (engine.gguf, dequantized to float32), into a param pytree.

Owns: the mapping from Hugging Face tensor names to the engine's layout. Each
layer keeps its own arrays (a list, not a stacked axis: slicing a stacked
weight inside the step copies it); q/k/v and gate/up are fused so each layer
does fewer, larger matmuls. Weights keep the checkpoint's (out, in) layout
here; `engine.model.matmul_layout` turns them to (in, out) once at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig, read_json
from engine.types import DTYPE_NAMES, CheckpointError

Params = dict[str, Any]

INDEX_FILE = "model.safetensors.index.json"
# the one table from a dtype name (engine.types.DTYPE_NAMES) to its type, host and device alike
NP_DTYPES = {name: np.dtype(getattr(ml_dtypes, name, name)) for name in DTYPE_NAMES}


class _TensorReader:
    """Looks tensors up by name across the checkpoint's safetensors files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.location = self._locate(folder)
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _locate(folder: Path) -> dict[str, Path]:
        index_path = folder / INDEX_FILE
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
            location = {name: folder / file for name, file in weight_map.items()}
            for file in sorted(set(location.values())):
                if not file.is_file():
                    raise CheckpointError(f"{file}: file not found (listed in {index_path})")
            return location
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors file found")
        location = {}
        for file in files:
            for name in _open(file).keys():  # noqa: SIM118 - safe_open is not a Mapping
                location[name] = file
        return location

    def get(self, name: str, shape: tuple[int, ...], part: tuple[slice, ...] = ()) -> np.ndarray:
        """Tensor `name`, checked to be of `shape`; `part` reads only that slice of it."""
        file = self.location.get(name)
        if file is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found in the checkpoint")
        if file not in self._handles:
            self._handles[file] = _open(file)
        try:
            tensor = self._handles[file].get_slice(name)
            found = tuple(tensor.get_shape())
            if found != shape:
                raise CheckpointError(
                    f"{self.folder}: tensor {name!r} has shape {found}, expected {shape}"
                )
            return tensor[part] if part else tensor[:]
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    def has(self, name: str) -> bool:
        return name in self.location


class _GGUFTensors:
    """Looks tensors up by their Hugging Face names in a prepared GGUF folder's file."""

    def __init__(self, folder: Path) -> None:
        from engine.gguf import TensorLoader

        self.loader = TensorLoader.open(folder)

    def get(self, name: str, shape: tuple[int, ...], part: tuple[slice, ...] = ()) -> np.ndarray:
        if name not in self.loader.index:
            raise CheckpointError(f"{self.loader.file}: tensor {name!r} not found in the GGUF file")
        tensor = self.loader.get(name)
        if tensor.shape != shape:
            raise CheckpointError(
                f"{self.loader.file}: tensor {name!r} has shape {tensor.shape}, expected {shape}"
            )
        return tensor[part] if part else tensor

    def has(self, name: str) -> bool:
        return name in self.loader.index


def _tensors(folder: Path) -> _TensorReader | _GGUFTensors:
    """A prepared GGUF folder's loader (engine.gguf_folder), else the safetensors reader."""
    from engine.gguf import INDEX_FILE

    return _GGUFTensors(folder) if (folder / INDEX_FILE).is_file() else _TensorReader(folder)


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def load_params(
    folder: str | Path, config: ModelConfig, dtype: str = "float32", shard: int = 0
) -> Params:
    """Host (numpy) params in `dtype`; placing them on devices is the engine's job.

    With config.shards > 1 (engine.config.tensor_parallel), the params of tensor-parallel
    shard `shard` only: its query heads, its (replicated) kv heads and its slice of the
    MLP, fused shard by shard, and its vocabulary rows of the head when the head is split
    (then an "lm_head" even for tied embeddings); read as slices, so no host copy of the
    whole model is made.
    """
    folder = Path(folder)
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    if not 0 <= shard < config.shards:
        raise ValueError(f"shard must be in 0..{config.shards - 1}, got {shard}")
    target = NP_DTYPES[dtype]
    reader = _tensors(folder)
    c = config
    h, d = c.hidden_size, c.head_dim
    kv_size = c.kv_size // c.kv_replicas  # the checkpoint's
    q_rows = _part(c.q_size // c.shards, shard)
    kv_per = c.num_kv_heads // c.shards  # kv heads of this shard, counting replicas
    first_kv = shard * kv_per // c.kv_replicas
    kv_rows = slice(first_kv * d, (first_kv + kv_per) * d)
    mlp_rows = _part(c.intermediate_size // c.shards, shard)
    every = slice(None)

    def get(name: str, shape: tuple[int, ...], *part: slice) -> np.ndarray:
        return reader.get(name, shape, tuple(part)).astype(target, copy=False)

    def layer(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        out = {
            "attn_norm": get(p + "input_layernorm.weight", (h,)),
            "wqkv": np.concatenate(
                [
                    get(attn + "q_proj.weight", (c.q_size, h), q_rows),
                    get(attn + "k_proj.weight", (kv_size, h), kv_rows),
                    get(attn + "v_proj.weight", (kv_size, h), kv_rows),
                ]
            ),
            "wo": get(attn + "o_proj.weight", (h, c.q_size), every, q_rows),
            "mlp_norm": get(p + "post_attention_layernorm.weight", (h,)),
            "w_gate_up": np.concatenate(
                [
                    get(mlp + "gate_proj.weight", (c.intermediate_size, h), mlp_rows),
                    get(mlp + "up_proj.weight", (c.intermediate_size, h), mlp_rows),
                ]
            ),
            "w_down": get(mlp + "down_proj.weight", (h, c.intermediate_size), every, mlp_rows),
        }
        if c.qkv_bias:
            out["bqkv"] = np.concatenate(
                [
                    get(attn + "q_proj.bias", (c.q_size,), q_rows),
                    get(attn + "k_proj.bias", (kv_size,), kv_rows),
                    get(attn + "v_proj.bias", (kv_size,), kv_rows),
                ]
            )
        if c.o_bias:
            out["bo"] = get(attn + "o_proj.bias", (h,))
        return out

    params: Params = {
        "embed": get("model.embed_tokens.weight", (c.vocab_size, h)),
        "layers": [layer(i) for i in range(c.num_layers)],
        "final_norm": get("model.norm.weight", (h,)),
    }
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    if c.head_shards > 1:
        vocab_rows = _part(c.vocab_size // c.head_shards, shard)
        params["lm_head"] = get(head, (c.vocab_size, h), vocab_rows)
    elif not c.tie_word_embeddings:
        params["lm_head"] = get(head, (c.vocab_size, h))
    return params


def _part(size: int, shard: int) -> slice:
    """The `shard`-th of equal parts of `size`."""
    return slice(shard * size, (shard + 1) * size)
