"""Device choice: a jax.sharding Mesh with a "model" axis is the only way devices are picked.

Owns: the default one-device mesh and the shardings params and state are placed
with. Everything is replicated today; tensor parallelism will give heads and
the KV cache a PartitionSpec over "model" here without touching the model code.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MODEL_AXIS = "model"


def default_mesh(num_devices: int = 1) -> Mesh:
    """The first `num_devices` devices on a 1-D mesh with the "model" axis."""
    devices = jax.devices()
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"num_devices must be in 1..{len(devices)}, got {num_devices}")
    return Mesh(np.array(devices[:num_devices]), (MODEL_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())
