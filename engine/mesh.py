"""Device choice: a jax.sharding Mesh with a "model" axis is the only way devices are picked.

Owns: which devices an engine runs on and where each array lives on them.
Tensor parallelism is GSPMD's: params and the KV cache are placed with a
PartitionSpec over "model" (heads and kv heads, the MLP's intermediate axis,
the head's vocabulary) and every jitted function is partitioned from those
placements; the model code only keeps each device's columns of a fused weight
together (engine.config.tensor_parallel). Everything else is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.checkpoint import load_params
from engine.config import ModelConfig

MODEL_AXIS = "model"
# Axis split over "model" of each layer matrix, in the (out, in) layout.
_LAYER_AXES = {"wqkv": 0, "bqkv": 0, "wo": 1, "w_gate_up": 0, "w_down": 1}
# int8 weights' scales (engine.quant), one per output row: split with the weight's rows
_LAYER_AXES |= {"wqkv_scale": 0, "w_gate_up_scale": 0}


def default_mesh(num_devices: int = 1) -> Mesh:
    """The first `num_devices` devices on a 1-D mesh with the "model" axis."""
    devices = jax.devices()
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"num_devices must be in 1..{len(devices)}, got {num_devices}")
    return Mesh(np.array(devices[:num_devices]), (MODEL_AXIS,))


def mesh_of(device_ids: Sequence[int]) -> Mesh:
    """These devices (ids as jax.devices() numbers them), in this order, on the "model" axis."""
    devices = {d.id: d for d in jax.devices()}
    missing = [i for i in device_ids if i not in devices]
    if missing or not device_ids or len(set(device_ids)) != len(device_ids):
        raise ValueError(f"devices {list(device_ids)}: each must be one of {sorted(devices)}, once")
    return Mesh(np.array([devices[i] for i in device_ids]), (MODEL_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def split(mesh: Mesh, axis: int) -> NamedSharding:
    """Axis `axis` split evenly over the "model" axis, the others whole.

    One device: replicated, the same sharding jit gives every output there; P(None,
    "model") on one device is equivalent but a different cache key, so a state placed
    with it and the state a step returns would each compile the step again.
    """
    if mesh.devices.size == 1:
        return replicated(mesh)
    return NamedSharding(mesh, PartitionSpec(*([None] * axis), MODEL_AXIS))


def param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """The sharding of every param (a pytree like params), by its name."""
    whole = replicated(mesh)

    def layer(lp: dict[str, Any]) -> dict[str, NamedSharding]:
        return {
            name: split(mesh, _LAYER_AXES[name]) if name in _LAYER_AXES else whole for name in lp
        }

    out: dict[str, Any] = {name: whole for name in params if name != "layers"}
    out["layers"] = [layer(lp) for lp in params["layers"]]
    if cfg.head_shards > 1:
        out["lm_head"] = split(mesh, 1)
    return out


def checkpoint_param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """Shardings of params in the checkpoint's layout (engine.paged_model): the layers as
    param_shardings has them, the embedding and an untied head, both (vocab, hidden),
    split by vocabulary rows when the vocabulary divides evenly (else copied whole)."""
    out = param_shardings({k: v for k, v in params.items() if k != "lm_head"}, cfg, mesh)
    vocab = split(mesh, 0) if cfg.head_shards > 1 else replicated(mesh)
    out["embed"] = vocab
    out.pop("lm_head", None)
    for name in ("lm_head", "embed_scale", "lm_head_scale"):
        if name in params:
            out[name] = vocab
    return out


def place_checkpoint_params(folder: Any, cfg: ModelConfig, dtype: str, mesh: Mesh) -> Any:
    """The checkpoint's params in its own layout (engine.paged_model) on the mesh, shard by
    shard as `place_params` reads them: the embedding split by vocabulary rows with the
    head (a tied head is the embedding itself, no second copy)."""
    if mesh.devices.size != cfg.shards:
        raise ValueError(f"a mesh of {mesh.devices.size} devices for {cfg.shards} shards")
    if cfg.shards == 1:
        host = load_params(folder, cfg, dtype)
        return jax.device_put(host, checkpoint_param_shardings(host, cfg, mesh))
    devices = list(mesh.devices.flat)
    rows = cfg.vocab_size // cfg.head_shards
    pieces: list[list[jax.Array]] = []
    treedef = None
    for shard, device in enumerate(devices):
        if device.process_index != jax.process_index():
            continue  # multi-host: another process reads that shard
        host = load_params(folder, cfg, dtype, shard)
        if cfg.head_shards > 1:
            host["embed"] = np.ascontiguousarray(host["embed"][shard * rows : (shard + 1) * rows])
            if cfg.tie_word_embeddings:
                del host["lm_head"]  # this shard's rows of the embedding, which it has
        leaves, treedef = jax.tree.flatten(host)
        pieces.append([jax.device_put(leaf, device) for leaf in leaves])
        del host, leaves
    assert treedef is not None
    shardings = jax.tree.leaves(
        checkpoint_param_shardings(jax.tree.unflatten(treedef, pieces[0]), cfg, mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    leaves = [
        _assemble([local[i] for local in pieces], sharding, len(devices))
        for i, sharding in enumerate(shardings)
    ]
    return jax.tree.unflatten(treedef, leaves)


def _assemble(parts: list[jax.Array], sharding: NamedSharding, shards: int) -> jax.Array:
    """One global array of `shards` parts under `sharding`, from this process's parts."""
    spec = sharding.spec
    if MODEL_AXIS not in spec:
        shape = parts[0].shape
    else:
        axis = list(spec).index(MODEL_AXIS)
        shape = tuple(n * (shards if a == axis else 1) for a, n in enumerate(parts[0].shape))
    return jax.make_array_from_single_device_arrays(shape, sharding, parts)


def parse_devices(text: str) -> int | tuple[int, ...]:
    """A device set as flags give it: a count ("2") or ids ("0,1", "2-3", "0-1,4")."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    ids: list[int] = []
    try:
        for part in text.split(","):
            if not part.strip():
                continue
            first, dash, last = part.partition("-")
            ids += range(int(first), int(last if dash else first) + 1)
    except ValueError as exc:
        raise ValueError(f"a device set is a count or ids like 0,1 or 2-3, got {text!r}") from exc
    if not ids:
        raise ValueError(f"a device set is a count or ids like 0,1 or 2-3, got {text!r}")
    return tuple(ids)


def device_sets(
    prefill: str, generate: str, available: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prefill and generate device ids: a count takes the first devices the other set
    does not (prefill's first); ids must exist, and the two sets must not overlap."""
    sets: list[tuple[int, ...]] = []
    for name, text in (("prefill_devices", prefill), ("generate_devices", generate)):
        spec = parse_devices(text)
        if isinstance(spec, int):
            left = [d for d in available if not sets or d not in sets[0]]
            if spec < 1 or spec > len(left):
                raise ValueError(
                    f"{name} {spec}: only {len(left)} of {len(available)} devices are left for it"
                )
            spec = tuple(left[:spec])
        missing = sorted(set(spec) - set(available))
        if missing or len(set(spec)) != len(spec):
            raise ValueError(
                f"{name} {list(spec)}: each must be one of the devices {list(available)}, once"
            )
        sets.append(spec)
    overlap = sorted(set(sets[0]) & set(sets[1]))
    if overlap:
        raise ValueError(f"prefill_devices and generate_devices share devices {overlap}")
    return sets[0], sets[1]
