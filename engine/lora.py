"""LoRA adapters: PEFT's files read into the device pool's slot layout, and the pool.

Owns: `LoraConfig` (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras), reading one
adapter folder (`read_adapter`: adapter_config.json + adapter_model.safetensors) into
host arrays shaped as one slot of the pool, the pool itself (`empty_pool`: per layer and
fused projection an A of (slots, in, rank) and a B of (slots, rank, out), zeros), and
`Adapters`, the core's registry of adapters by name with a host cache of their arrays.
Receives folders and names; emits host arrays and `write_slot`'s new params. The math
that applies a slot per token is engine.model's `lora_delta`.

Layout: the engine's projections are fused (q/k/v as "wqkv", gate/up as "w_gate_up"), so
a slot of a fused projection holds one rank block per part: A (in, parts * rank), B
(parts * rank, out) with each part's B rows only in its own output columns, in the order
the fused weight has them (per tensor-parallel shard its q, k, v). A rank below
`max_lora_rank` is zero-padded; PEFT's scaling (lora_alpha / r, or lora_alpha / sqrt(r)
with rslora) is folded into B. A projection the adapter does not target stays zeros.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from engine.checkpoint import NP_DTYPES
from engine.config import ModelConfig
from engine.core.config import LoraConfig
from engine.mesh import replicated, split

# PEFT's module name -> (the engine's fused weight, its part in it)
TARGETS = {
    "q_proj": ("wqkv", 0),
    "k_proj": ("wqkv", 1),
    "v_proj": ("wqkv", 2),
    "o_proj": ("wo", 0),
    "gate_proj": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "down_proj": ("w_down", 0),
}
PARTS = {"wqkv": 3, "wo": 1, "w_gate_up": 2, "w_down": 1}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# A pool array's axis split over the mesh, as its weight's (engine.mesh): B's output
# columns of the fused q/k/v and gate/up, A's input rows of the o and down projections.
POOL_AXES = {"lora_b_wqkv": 2, "lora_b_w_gate_up": 2, "lora_a_wo": 1, "lora_a_w_down": 1}
NO_ADAPTER = -1  # a token's slot index when its row has none (its delta is zero)


SlotArrays = list[dict[str, np.ndarray]]  # per layer: pool name -> one slot's array


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each fused weight's (in, out), as the step computes it (all shards together)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "wqkv": (h, cfg.q_size + 2 * cfg.kv_size),
        "wo": (cfg.q_size, h),
        "w_gate_up": (h, 2 * inter),
        "w_down": (inter, h),
    }


def _columns(cfg: ModelConfig, weight: str, part: int) -> np.ndarray:
    """The fused output columns the rows of a part of wo, w_gate_up or w_down go to, in
    the checkpoint's row order (engine.checkpoint.load_params, shard by shard)."""
    if weight == "w_gate_up":
        per = cfg.intermediate_size // cfg.shards
        gate = np.concatenate([s * 2 * per + np.arange(per) for s in range(cfg.shards)])
        return gate + part * per
    return np.arange(_shapes(cfg)[weight][1])


def _fill_qkv(b: np.ndarray, block: slice, rows: np.ndarray, cfg: ModelConfig, part: int) -> None:
    """B's q (part 0), k or v (1, 2) rows (rank, checkpoint rows) into the fused q/k/v
    columns: per shard its q heads, then its k and v heads (a kv head copied to several
    shards, engine.config.tensor_parallel, into each copy)."""
    shards, d = cfg.shards, cfg.head_dim
    q_per, kv_per = cfg.q_size // shards, cfg.num_kv_heads // shards
    width = q_per + 2 * kv_per * d
    for s in range(shards):
        if part == 0:
            b[block, s * width : s * width + q_per] = rows[:, s * q_per : (s + 1) * q_per]
            continue
        first = s * kv_per // cfg.kv_replicas * d
        base = s * width + q_per + (part - 1) * kv_per * d
        b[block, base : base + kv_per * d] = rows[:, first : first + kv_per * d]


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder's settings as PEFT wrote them, checked."""

    rank: int
    scaling: float
    targets: tuple[str, ...]


def read_config(folder: Path, max_rank: int) -> AdapterFiles:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        rank, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
        targets = raw["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"LoRA adapter {folder}: malformed adapter_config.json ({exc})") from exc
    if isinstance(targets, str) or not isinstance(targets, list):
        raise ValueError(
            f"LoRA adapter {folder}: target_modules must be a list of module names, got {targets!r}"
        )
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(
            f"LoRA adapter {folder}: target modules {unknown} are not supported "
            f"(supported: {sorted(TARGETS)})"
        )
    for name, allowed in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if raw.get(name, allowed) not in (allowed, None):
            raise ValueError(f"LoRA adapter {folder}: {name}={raw[name]!r} is not supported")
    for name in (
        "modules_to_save",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "layer_replication",
        "trainable_token_indices",
        "target_parameters",
        "lora_bias",
    ):
        if raw.get(name):
            raise ValueError(f"LoRA adapter {folder}: {name} is not supported")
    if not 1 <= rank <= max_rank:
        raise ValueError(
            f"LoRA adapter {folder}: rank {rank} exceeds --max-lora-rank {max_rank}"
            if rank > max_rank
            else f"LoRA adapter {folder}: rank must be >= 1, got {rank}"
        )
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    # peft writes target_modules from a set: one order (the model's) names the same
    # first bad tensor on every run.
    return AdapterFiles(rank, scaling, tuple(t for t in TARGETS if t in targets))


def read_adapter(folder: str | Path, cfg: ModelConfig, max_rank: int, dtype: str) -> SlotArrays:
    """One adapter as a slot of the pool (host arrays in `dtype`), or ValueError saying
    what is wrong with its files (missing, malformed, a rank past `max_rank`, a tensor
    whose shape is not the base model's)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {folder}: no such folder")
    files = read_config(folder, max_rank)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_model.safetensors")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, ValueError, TypeError) as exc:  # TypeError: a dtype
        raise ValueError(f"LoRA adapter {folder}: unreadable safetensors ({exc})") from exc
    shapes = _shapes(cfg)
    sizes = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size // cfg.kv_replicas}
    sizes |= {"v_proj": sizes["k_proj"], "o_proj": cfg.hidden_size}
    sizes |= {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    sizes |= {"down_proj": cfg.hidden_size}
    ins = {t: shapes[TARGETS[t][0]][0] for t in TARGETS}
    r, rmax = files.rank, max_rank
    used: set[str] = set()
    layers: SlotArrays = []
    for i in range(cfg.num_layers):
        slot: dict[str, np.ndarray] = {}
        for weight, parts in PARTS.items():
            n_in, n_out = shapes[weight]
            slot["lora_a_" + weight] = np.zeros((n_in, parts * rmax), np.float32)
            slot["lora_b_" + weight] = np.zeros((parts * rmax, n_out), np.float32)
        for target in files.targets:
            weight, part = TARGETS[target]
            where = "self_attn" if target in ATTENTION else "mlp"
            name = f"base_model.model.model.layers.{i}.{where}.{target}"
            a = _tensor(tensors, f"{name}.lora_A.weight", (r, ins[target]), folder)
            b = _tensor(tensors, f"{name}.lora_B.weight", (sizes[target], r), folder)
            used |= {f"{name}.lora_A.weight", f"{name}.lora_B.weight"}
            block = slice(part * rmax, part * rmax + r)
            slot["lora_a_" + weight][:, block] = a.T
            scaled = b.T * files.scaling
            if weight == "wqkv":
                _fill_qkv(slot["lora_b_" + weight], block, scaled, cfg, part)
            else:
                slot["lora_b_" + weight][block, _columns(cfg, weight, part)] = scaled
        layers.append({k: v.astype(NP_DTYPES[dtype]) for k, v in slot.items()})
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"LoRA adapter {folder}: tensors not for the base model: {extra[:3]}")
    return layers


def _tensor(
    tensors: dict[str, np.ndarray], name: str, shape: tuple[int, int], folder: Path
) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"LoRA adapter {folder}: missing tensor {name}")
    value = tensors[name]
    if value.shape != shape:
        raise ValueError(
            f"LoRA adapter {folder}: {name} has shape {list(value.shape)}, the base model "
            f"needs {list(shape)}"
        )
    return value.astype(np.float32)


def pool_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int, int]]:
    """One layer's pool arrays: name -> (slots, in, parts * rank) for A, (slots, parts *
    rank, out) for B."""
    out = {}
    slots, rmax = lora.max_loras, lora.max_lora_rank
    for weight, (n_in, n_out) in _shapes(cfg).items():
        out["lora_a_" + weight] = (slots, n_in, PARTS[weight] * rmax)
        out["lora_b_" + weight] = (slots, PARTS[weight] * rmax, n_out)
    return out


def pool_sharding(mesh: Mesh, name: str) -> NamedSharding:
    """A pool array's sharding: split as its weight is (POOL_AXES), else whole."""
    return split(mesh, POOL_AXES[name]) if name in POOL_AXES else replicated(mesh)


def empty_pool(cfg: ModelConfig, lora: LoraConfig, dtype: str, mesh: Mesh) -> SlotArrays:
    """Per layer the pool's arrays (zeros, every slot empty), split over the mesh with
    their layers (POOL_AXES)."""
    shapes = pool_shapes(cfg, lora)
    return [
        {
            name: jax.device_put(np.zeros(shape, NP_DTYPES[dtype]), pool_sharding(mesh, name))
            for name, shape in shapes.items()
        }
        for _ in range(cfg.num_layers)
    ]


@jax.jit
def _write(pool: dict[str, jax.Array], slot: jax.Array, value: dict[str, jax.Array]) -> dict:
    return {k: pool[k].at[:, slot].set(value[k]) for k in pool}


def write_slot(params: dict, slot: int, value: SlotArrays) -> dict:
    """Params whose pool slot `slot` holds `value` (the other slots as they were), each
    array where it was; functional, so a step already dispatched reads the old pool.
    Params are the runner's, layers stacked (engine.paged_model.stack_layers): a pool
    array is (layers, slots, ...)."""
    layers = params["layers"]
    pool = {k: v for k, v in layers.items() if k.startswith("lora_")}
    stacked = {k: np.stack([arrays[k] for arrays in value]) for k in pool}
    written = _write(pool, np.int32(slot), stacked)
    placed = {k: jax.device_put(v, pool[k].sharding) for k, v in written.items()}
    return params | {"layers": layers | placed}


def zero_slot(params: dict) -> SlotArrays:
    """One slot's arrays of the (stacked) params' pool, zeros (no adapter): what warm-up
    writes, so the slot write is compiled before the first adapter is loaded."""
    pool = {k: v for k, v in params["layers"].items() if k.startswith("lora_")}
    layers = next(iter(pool.values())).shape[0]
    return [{k: np.zeros(v.shape[2:], v.dtype) for k, v in pool.items()} for _ in range(layers)]


def with_pool(params: dict, pool: SlotArrays) -> dict:
    """Params with the pool's arrays beside each layer's weights (engine.model reads them)."""
    return params | {"layers": [lp | p for lp, p in zip(params["layers"], pool, strict=True)]}


@dataclass
class _Record:
    name: str
    path: Path


@dataclass
class Adapters:
    """The core's adapters: a unique id per load (a name loaded again is a new id, so no
    cached prefix or resident slot of the old files is taken for the new), and up to
    `cpu_loras` of them as host arrays, least recently used dropped first (read again
    from their folder when wanted)."""

    cfg: ModelConfig
    lora: LoraConfig
    dtype: str
    by_name: dict[str, int] = field(default_factory=dict)
    _records: dict[int, _Record] = field(default_factory=dict)
    _host: OrderedDict[int, SlotArrays] = field(default_factory=OrderedDict)

    def load(self, name: str, path: str | Path) -> int:
        """Read and check an adapter; its id (ValueError: its files are bad, or the name
        is taken)."""
        if name in self.by_name:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        arrays = read_adapter(path, self.cfg, self.lora.max_lora_rank, self.dtype)
        adapter = len(self._records) + 1
        self._records[adapter] = _Record(name, Path(path))
        self.by_name[name] = adapter
        self._keep(adapter, arrays)
        return adapter

    def resolve(self, name: str) -> int:
        """The id of the adapter a request names ("": the base model, 0)."""
        if not name:
            return 0
        if name not in self.by_name:
            raise ValueError(f"The model `{name}` does not exist.")
        return self.by_name[name]

    def name_of(self, adapter: int) -> str:
        return self._records[adapter].name

    def unload(self, name: str) -> None:
        """No new request may name it; sequences already holding its id finish with it."""
        if name not in self.by_name:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        del self.by_name[name]

    def arrays(self, adapter: int) -> SlotArrays:
        arrays = self._host.get(adapter)
        if arrays is None:
            record = self._records[adapter]
            arrays = read_adapter(record.path, self.cfg, self.lora.max_lora_rank, self.dtype)
            self._keep(adapter, arrays)
        self._host.move_to_end(adapter)
        return arrays

    def _keep(self, adapter: int, arrays: SlotArrays) -> None:
        self._host[adapter] = arrays
        while len(self._host) > self.lora.cpu_loras:
            self._host.popitem(last=False)
