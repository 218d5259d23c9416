"""Per-backend defaults for what the config leaves unset: the one table of them.

Owns: `BACKEND_DEFAULTS` (platform -> `BackendDefaults`) and `defaults_for`. Receives a
platform name ("cpu", "tpu", "gpu"); emits the prompt chunk (and the one beside decode
rows), KV page size and memory fraction the engine core uses where its config gives None,
with where each figure comes from. engine.core.core resolves its config through it, once,
at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendDefaults:
    chunk_size: int  # prompt positions per chunk
    page_size: int  # positions per KV page
    memory_utilization: float  # of each device's memory for params + KV (vLLM's default 0.9)
    source: str  # where the figures come from
    # prompt positions per chunk in a step that has decode rows, where the attention
    # backend lets a chunk begin anywhere (engine.core.scheduler); None: chunk_size
    decode_chunk_size: int | None = None
    # GPU: the share of the device jax's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION,
    # set by engine.xla_flags before jax starts; jax's own default is 0.75). The engine
    # sizes its pages from what that allocator reports, so memory_utilization is a share
    # of this share. None: the platform's allocator as it comes.
    allocator_fraction: float | None = None


AWAITING_MEASUREMENT = "awaiting measurement on a GPU (bench.gpu_decode; today's values kept)"

BACKEND_DEFAULTS = {
    # Served against vLLM on 2 cores, chunks of 128 against 256 (3 rounds): first tokens
    # 0.60-0.68x as late at c = 8 and 32 and the inter-token p99 0.69-0.71x, output tok/s
    # level (bench/README.md, "Prompt rows in the kernel").
    # Beside decode rows, whole chunks too: chunks of 32 there cut the inter-token p99
    # at c = 8 (175 -> 109 ms) but cost c = 32 a tenth of its output rate and doubled
    # first tokens at 8 and 32 (bfloat16, 3 rounds against vLLM; bench/README.md,
    # "Smaller chunks beside decode rows"): --prefill-chunk-beside-decode 32 chooses it.
    "cpu": BackendDefaults(128, 16, 0.9, 'bench/README.md, "Prompt rows in the kernel"'),
    # A TPU step reads every weight once per chunk: a 1,024-token prompt's roofline time
    # over one pass over the weights and its K/V, the 8B at TP 4 on v6e compiled as the
    # server compiles it: 1.72x in chunks of 512, 1.09x in one chunk of 1,024 (the 1B
    # on v5e: 1.34x and 1.18x with every array counted in HBM; bench/README.md, "TPU
    # programs", "The prompt chunk on TPU").
    "tpu": BackendDefaults(1024, 16, 0.9, 'bench/README.md, "TPU programs"'),
    # Not yet measured on a GPU: the values served before this table existed.
    # The allocator's share: deploy/overlays/gpu's 0.90, now the engine's own default.
    "gpu": BackendDefaults(256, 16, 0.9, AWAITING_MEASUREMENT, allocator_fraction=0.9),
}


def defaults_for(platform: str) -> BackendDefaults:
    """The platform's defaults (an unknown platform gets the CPU's)."""
    return BACKEND_DEFAULTS.get(platform, BACKEND_DEFAULTS["cpu"])
