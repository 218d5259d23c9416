"""Build the backend a config asks for: checkpoint (or the demo), engine, warm-up, orchestrator.

Runs on: the runtime's loader thread, once. Slow (loads weights and compiles
every shape); the HTTP server answers the probes meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from server.backend import Backend
from server.config import ServerConfig

logger = logging.getLogger(__name__)


def ensure_demo_model(folder: Path) -> Path:
    """The embedded demo checkpoint, built deterministically on first use."""
    from engine.tiny import write_tiny_checkpoint

    if (folder / "config.json").is_file():
        return folder
    logger.info("building the demo model", extra={"path": str(folder)})
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".partial")
    write_tiny_checkpoint(tmp, arch="llama", seed=0)
    tmp.replace(folder)  # atomic: a crash mid-build never leaves a half model behind
    return folder


def model_path(config: ServerConfig) -> Path:
    if config.model is not None:
        return config.model
    return ensure_demo_model(config.demo_model_dir)


def enable_compile_cache(config: ServerConfig) -> Path | None:
    """Keep XLA's compiled programs on disk, so a restart warms up from them.

    Warm-up compiles every shape (minutes on a 100M model); a restart, or a pod that finds
    the previous one's volume, reads them back instead. JAX_COMPILATION_CACHE_DIR, when
    set (the container image sets it), wins. Returns the folder in use, None when off.
    """
    import jax

    if not config.compile_cache:
        return None
    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if current:
        return Path(current)
    folder = config.compile_cache_dir
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every shape
    return folder


def build_engines(config: ServerConfig) -> tuple[Any, Any]:
    """(prefill engine or None, engine), loaded and warmed up; None: one engine does both."""
    import jax

    folder = enable_compile_cache(config)
    logger.info("compile cache: %s", folder or "off")

    from engine.engine import Engine, EngineConfig
    from engine.mesh import device_sets

    path = model_path(config)
    shapes = EngineConfig(
        model_path=path,
        dtype=config.dtype,
        max_slots=config.max_slots,
        max_model_len=config.max_model_len,
        prefill_buckets=_fit_buckets(config.prefill_buckets, config.max_model_len),
        max_prefill_batch=config.max_prefill_batch,
        prefill_chunk=config.prefill_chunk or None,
        prefix_cache_blocks=config.prefix_cache_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        vocab_major_head=config.vocab_major_head,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    if config.num_processes > 1 and config.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size}: a multi-host server shards "
            f"the model over all {jax.device_count()} devices of its {config.num_processes} "
            "processes"
        )
    if config.prefill_devices is None or config.generate_devices is None:
        engine = Engine(shapes)
        engine.warmup()
        return None, engine
    prefill_ids, generate_ids = device_sets(
        config.prefill_devices, config.generate_devices, [d.id for d in jax.devices()]
    )
    for name, ids in (("prefill_devices", prefill_ids), ("generate_devices", generate_ids)):
        if config.tensor_parallel_size not in (1, len(ids)):
            raise ValueError(
                f"{name} {list(ids)}: each set is one tensor-parallel mesh of its "
                f"devices, not of tensor_parallel_size {config.tensor_parallel_size}"
            )
    prefill_engine = Engine(_on(shapes, prefill_ids))
    engine = Engine(_on(dataclasses.replace(shapes, prefix_cache_blocks=0), generate_ids))
    prefill_engine.warmup(generate=False)
    engine.warmup(prefill=False)
    logger.info("disaggregated: prefill on %s, generate on %s", prefill_ids, generate_ids)
    return prefill_engine, engine


def load_core(config: ServerConfig, text_streams: Any, eos_token_ids: Any) -> Any:
    """The engine core over paged KV in its own process, warmed up, behind an EngineClient
    (--engine paged): one tensor-parallel mesh, on one host or (multi-host) over every
    process's devices, the core process leading the others (engine.multihost)."""
    from engine.client import EngineClient
    from engine.stages.faults import FaultPlan

    if config.prefill_devices is not None:
        raise ValueError("--engine paged does not support prefill_devices yet")
    folder = enable_compile_cache(config)
    logger.info("compile cache: %s", folder or "off")
    fault = None if config.fault_injection is None else FaultPlan.parse(config.fault_injection)
    core = {
        "model_path": str(model_path(config)),
        "dtype": config.dtype,
        "max_num_seqs": config.max_slots,
        "max_model_len": config.max_model_len,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "chunk_size": config.prefill_chunk or 256,
        "page_size": config.page_size,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "prefix_caching": config.prefix_caching,
        "tensor_parallel_size": config.tensor_parallel_size,
    }
    client = EngineClient(
        core,
        text_streams,
        eos_token_ids,
        max_queued_samples=config.max_queued_samples,
        log_level=logging.getLogger().getEffectiveLevel(),
        compile_cache_dir=None if folder is None else str(folder),
        fail_after_steps=None if fault is None else fault.after,
        num_processes=config.num_processes,
        coordinator_address=config.coordinator_address,
        distributed_timeout=config.distributed_timeout,
    )
    client.start()
    return client


def load_backend(config: ServerConfig) -> Backend:
    """Load, warm up and start; raises on any failure (the runtime reports it)."""
    from engine.orchestrator import Orchestrator, OrchestratorConfig
    from engine.stages.detokenize import text_streams
    from tokenization import Tokenizer

    path = model_path(config)
    template = config.chat_template.read_text(encoding="utf-8") if config.chat_template else None
    tokenizer = Tokenizer.from_folder(path, chat_template=template)
    if config.engine == "paged":
        from engine.config import load_model_config

        eos = tokenizer.eos_token_ids | frozenset(load_model_config(path).eos_token_ids)
        client = load_core(config, text_streams(tokenizer.detokenizer, eos), eos)
        return Backend(tokenizer=tokenizer, orchestrator=client, limits=client.limits)
    prefill_engine, engine = build_engines(config)
    eos = tokenizer.eos_token_ids | engine.eos_token_ids
    orchestrator = Orchestrator(
        engine,
        text_streams(tokenizer.detokenizer, eos),
        OrchestratorConfig(
            max_queued_samples=config.max_queued_samples,
            # room for a whole prefill batch between prefill and insert
            prefill_queue_size=max(OrchestratorConfig.prefill_queue_size, config.max_prefill_batch),
            fault_injection=config.fault_injection,
        ),
        prefill_engine=prefill_engine,
    )
    orchestrator.start()
    limits = engine.limits
    return Backend(tokenizer=tokenizer, orchestrator=orchestrator, limits=limits)


def _on(shapes: Any, ids: tuple[int, ...]) -> Any:
    """The engine config `shapes` on the devices `ids`, one tensor-parallel mesh of them."""
    return dataclasses.replace(shapes, devices=ids, tensor_parallel_size=len(ids))


def _fit_buckets(
    buckets: tuple[int, ...] | None, max_model_len: int | None
) -> tuple[int, ...] | None:
    """Buckets beyond the context are useless: drop them rather than refuse to start."""
    if buckets is None or max_model_len is None:
        return buckets
    kept = tuple(b for b in buckets if b <= max_model_len)
    return kept or (max_model_len - 1,)
