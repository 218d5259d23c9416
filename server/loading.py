"""Build the backend a config asks for: checkpoint, tokenizer, the engine core.

Runs on: the runtime's loader thread, once. Slow (loads weights and compiles
every shape); the HTTP server answers the probes meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from server.backend import Backend
from server.config import ServerConfig

logger = logging.getLogger(__name__)


def model_path(config: ServerConfig) -> Path:
    """The checkpoint folder `--model` names (engine.model_source: a GGUF prepared, the
    default model fetched, the demo built, each once)."""
    from engine.model_source import resolve

    return resolve(config.model, config.resolved_cache_dir).folder


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


def load_core(config: ServerConfig, text_streams: Any, eos_token_ids: Any) -> Any:
    """The engine core over paged KV in its own process, warmed up, behind an EngineClient:
    one tensor-parallel mesh, on one host or (multi-host) over every process's devices,
    the core process leading the others (engine.multihost); or a prefill and a decode
    device set (engine.core.disaggregated)."""
    from engine.client import EngineClient
    from engine.faults import FaultPlan

    folder = enable_compile_cache(config)
    logger.info("compile cache: %s", folder or "off")
    fault = None if config.fault_injection is None else FaultPlan.parse(config.fault_injection)
    core = {
        "model_path": str(model_path(config)),
        "dtype": config.dtype,
        "quantization": config.quantization or "none",
        "kv_cache_dtype": config.kv_cache_dtype,
        "max_num_seqs": config.max_num_seqs,
        "max_model_len": config.max_model_len,
        "max_num_batched_tokens": config.batched_tokens,
        "chunk_size": config.prefill_chunk,
        "page_size": config.page_size,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "memory_utilization": config.gpu_memory_utilization,
        "prefix_caching": config.prefix_caching,
        "async_scheduling": config.async_scheduling,
        "tensor_parallel_size": config.tensor_parallel_size,
        "speculative_config": config.speculative_config,
    }
    if config.enable_lora:  # the core reads (and checks) each adapter before it is ready
        core |= {
            "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "max_cpu_loras": config.max_cpu_loras,
            "lora_modules": [(m.name, m.path) for m in config.lora_modules],
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
        prefill_devices=config.prefill_devices,
        generate_devices=config.generate_devices,
    )
    client.start()
    return client


def load_backend(config: ServerConfig) -> Backend:
    """Load, warm up and start; raises on any failure (the runtime reports it)."""
    from engine.config import load_model_config
    from engine.text import text_streams
    from tokenization import Tokenizer

    path = model_path(config)
    template = config.chat_template.read_text(encoding="utf-8") if config.chat_template else None
    tokenizer = Tokenizer.from_folder(path, chat_template=template)
    eos = tokenizer.eos_token_ids | frozenset(load_model_config(path).eos_token_ids)
    client = load_core(config, text_streams(tokenizer.detokenizer, eos), eos)
    return Backend(tokenizer=tokenizer, engine=client, limits=client.limits, eos_token_ids=eos)
