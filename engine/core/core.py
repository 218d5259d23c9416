"""The engine core: a scheduler and a runner for one device set, advanced one step a call.

Runs on: one thread, the core's loop (nano-vllm's `step`, vLLM V1's EngineCore). Owns
the scheduler and the runner it builds from a checkpoint and a `CoreConfig`. Receives
sequences (`add`, `abort`); emits each step's `Emitted` tokens.

The KV cache gets its pages from a byte budget (`kv_cache_memory_bytes`) or a page
count; a budget that cannot hold one max_model_len sequence is an error at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax

from engine.attention import KVLayout, attention_backend
from engine.checkpoint import NP_DTYPES, load_params
from engine.config import load_model_config
from engine.core.pages import PagePool, PageStats
from engine.core.runner import Runner
from engine.core.scheduler import Emitted, Scheduler, SchedulerConfig, Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreConfig:
    """What to load and the shapes to serve it with (vLLM's names where they exist)."""

    model_path: str | Path
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_model_len: int = 512
    max_num_batched_tokens: int = 256
    chunk_size: int = 128  # prompt positions per chunk
    page_size: int = 16
    num_pages: int | None = None  # or from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in NP_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {self.dtype!r}")
        if (self.num_pages is None) == (self.kv_cache_memory_bytes is None):
            raise ValueError("give exactly one of num_pages and kv_cache_memory_bytes")


class EngineCore:
    def __init__(self, config: CoreConfig) -> None:
        cfg = load_model_config(config.model_path)
        self.config = config
        self.model_config = cfg
        platform = jax.devices()[0].platform
        fold = 128 // cfg.head_dim if platform == "tpu" and cfg.head_dim < 128 else 1
        probe = KVLayout(1, config.page_size, cfg.num_kv_heads, cfg.head_dim, config.dtype, fold)
        num_pages = config.num_pages
        if num_pages is None:
            assert config.kv_cache_memory_bytes is not None
            num_pages = config.kv_cache_memory_bytes // (probe.page_bytes * cfg.num_layers)
        layout = KVLayout(
            num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim, config.dtype, fold
        )
        pool = PagePool(num_pages, config.page_size, prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                chunk_size=config.chunk_size,
            ),
            pool,
        )
        params = jax.device_put(load_params(config.model_path, cfg, config.dtype))
        self.runner = Runner(
            params,
            cfg,
            layout,
            attention_backend(platform, layout),
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=cfg.eos_token_ids,
        )
        self.kv_cache_bytes = layout.page_bytes * num_pages * cfg.num_layers
        logger.info(
            "engine core: %d pages of %d positions (%d bytes of KV), %d sequences, "
            "%d tokens a step",
            num_pages,
            config.page_size,
            self.kv_cache_bytes,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.model_config.eos_token_ids)

    def warmup(self) -> None:
        self.runner.warmup()

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq_id: str) -> bool:
        return self.scheduler.abort(seq_id)

    def page_stats(self) -> PageStats:
        return self.scheduler.pool.stats()

    def step(self) -> list[Emitted]:
        """One scheduled step run on the devices; [] when there is nothing to run."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        return self.scheduler.update(plan, self.runner.step(plan))
