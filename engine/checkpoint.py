"""Weights read from *.safetensors (one file or sharded with an index) into a param pytree.

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

    def get(self, name: str) -> np.ndarray:
        file = self.location.get(name)
        if file is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found in the checkpoint")
        if file not in self._handles:
            self._handles[file] = _open(file)
        try:
            return self._handles[file].get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    def has(self, name: str) -> bool:
        return name in self.location


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def _expect(array: np.ndarray, shape: tuple[int, ...], name: str, folder: Path) -> np.ndarray:
    if tuple(array.shape) != shape:
        raise CheckpointError(
            f"{folder}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}"
        )
    return array


def load_params(folder: str | Path, config: ModelConfig, dtype: str = "float32") -> Params:
    """Host (numpy) params in `dtype`; placing them on devices is the engine's job."""
    folder = Path(folder)
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    target = NP_DTYPES[dtype]
    reader = _TensorReader(folder)
    c = config
    h = c.hidden_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _expect(reader.get(name), shape, name, folder).astype(target)

    def layer(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}."
        out = {
            "attn_norm": get(p + "input_layernorm.weight", (h,)),
            "wqkv": np.concatenate(
                [
                    get(p + "self_attn.q_proj.weight", (c.q_size, h)),
                    get(p + "self_attn.k_proj.weight", (c.kv_size, h)),
                    get(p + "self_attn.v_proj.weight", (c.kv_size, h)),
                ]
            ),
            "wo": get(p + "self_attn.o_proj.weight", (h, c.q_size)),
            "mlp_norm": get(p + "post_attention_layernorm.weight", (h,)),
            "w_gate_up": np.concatenate(
                [
                    get(p + "mlp.gate_proj.weight", (c.intermediate_size, h)),
                    get(p + "mlp.up_proj.weight", (c.intermediate_size, h)),
                ]
            ),
            "w_down": get(p + "mlp.down_proj.weight", (h, c.intermediate_size)),
        }
        if c.qkv_bias:
            out["bqkv"] = np.concatenate(
                [
                    get(p + "self_attn.q_proj.bias", (c.q_size,)),
                    get(p + "self_attn.k_proj.bias", (c.kv_size,)),
                    get(p + "self_attn.v_proj.bias", (c.kv_size,)),
                ]
            )
        if c.o_bias:
            out["bo"] = get(p + "self_attn.o_proj.bias", (h,))
        return out

    params: Params = {
        "embed": get("model.embed_tokens.weight", (c.vocab_size, h)),
        "layers": [layer(i) for i in range(c.num_layers)],
        "final_norm": get("model.norm.weight", (h,)),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (c.vocab_size, h))
    return params
