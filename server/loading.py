"""Build the backend a config asks for: checkpoint, tokenizer, the engine core.

Runs on: the runtime's loader thread, once. Slow (the core process loads weights and
compiles every shape); the HTTP server answers the probes meanwhile. Never imports JAX
itself.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from server.backend import Backend
from server.config import ServerConfig

if TYPE_CHECKING:
    from frontend.client import EngineClient
    from frontend.text import TextStreamFactory

logger = logging.getLogger(__name__)


def model_path(config: ServerConfig) -> Path:
    """The checkpoint folder `--model` names (engine.model_source: a GGUF prepared, the
    default model fetched, the demo built, each once)."""
    from engine.model_source import resolve

    return resolve(config.model, config.resolved_cache_dir).folder


def enable_compile_cache(config: ServerConfig) -> Path | None:
    """A multi-host follower's compile cache (it runs a core itself; process 0's core sets
    its own): the folder in use (JAX_COMPILATION_CACHE_DIR, when set, wins), None when off."""
    from engine.core.process import enable_compile_cache as enable

    if not config.compile_cache:
        return None
    return Path(enable(str(config.compile_cache_dir)))


def load_core(config: ServerConfig, text_streams: TextStreamFactory) -> EngineClient:
    """The engine core over paged KV in its own process, warmed up, behind an EngineClient:
    one tensor-parallel mesh, on one host or (multi-host) over every process's devices,
    the core process leading the others (engine.multihost); or a prefill and a decode
    device set (engine.core.disaggregated). The core process sets up the compile cache."""
    from engine.core.process import ProcessConfig
    from engine.faults import FaultPlan
    from frontend.client import EngineClient

    fault = None if config.fault_injection is None else FaultPlan.parse(config.fault_injection)
    process = ProcessConfig(
        core=config.core_config(str(model_path(config))),
        log_level=logging.getLogger().getEffectiveLevel(),
        compile_cache_dir=str(config.compile_cache_dir) if config.compile_cache else None,
        fail_after_steps=None if fault is None else fault.after,
        num_processes=config.num_processes,  # multi-host: the core leads (engine.multihost)
        coordinator_address=config.coordinator_address,
        distributed_timeout=config.distributed_timeout,
        prefill_devices=config.prefill_devices,  # disaggregated (engine.core.disaggregated)
        generate_devices=config.generate_devices,
    )
    client = EngineClient(process, text_streams, max_queued_samples=config.max_queued_samples)
    client.start()
    return client


def load_backend(config: ServerConfig) -> Backend:
    """Load, warm up and start; raises on any failure (the runtime reports it)."""
    from frontend.text import Detokenizer, text_streams
    from tokenization import Tokenizer

    path = model_path(config)
    template = config.chat_template.read_text(encoding="utf-8") if config.chat_template else None
    # The tokenizer loads (seconds: transformers' import) while the core process starts
    # and warms up; a request needs it only once both are done.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        loading = pool.submit(Tokenizer.from_folder, path, chat_template=template)

        def detokenizer(ids: tuple[int, ...], skip_special: bool) -> Detokenizer:
            return loading.result().detokenizer(ids, skip_special)

        try:
            client = load_core(config, text_streams(detokenizer))
        except BaseException:
            loading.cancel()
            raise
        try:
            tokenizer = loading.result()
        except BaseException:
            client.stop()
            raise
    return Backend(
        tokenizer=tokenizer,
        engine=client,
        limits=client.limits,
        eos_token_ids=client.eos_token_ids,  # the core's (beam search reads them)
    )
