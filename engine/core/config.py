"""The engine core's configuration, JAX-free: what a core serves with, and its bounds.

Owns: `CoreConfig`, what a core loads and the shapes it serves with (vLLM's names where
they exist), and the rule for each of its fields; and `SchedulerConfig`, the bounds one
scheduler plans within (the core derives it from its CoreConfig and the backend).
A CoreConfig is built once by the server from its flags (ServerConfig.core_config),
validated there (so a bad flag fails before anything starts), sent to the core process
as JSON (engine.core.process.ProcessConfig) and rebuilt, with the same checks, where it
is used (engine.core.core.EngineCore).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.core.speculation import SpeculativeConfig
from engine.types import ATTENTION_BACKENDS, DTYPE_NAMES, KV_CACHE_DTYPES, QUANTIZATIONS

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class LoraConfig:
    """vLLM's LoRA flags: adapters resident on the devices at once, the largest rank a
    slot holds, and adapters whose arrays stay in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class CoreConfig:
    """What to load and the shapes to serve it with (vLLM's names where they exist)."""

    model_path: str | Path
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: the model's, at most DEFAULT_MAX_MODEL_LEN
    max_num_batched_tokens: int | None = 256  # None: a chunk + every row
    chunk_size: int | None = 128  # prompt positions per chunk; None: the backend's
    # per chunk in a step with decode rows (where any chunk keeps a query's bits); None:
    # the backend's (engine.core.defaults), at most chunk_size
    decode_chunk_size: int | None = None
    max_prefill_seqs: int = 4  # prompt chunks per step
    page_size: int | None = 16  # None: the backend's (engine.core.defaults)
    num_pages: int | None = None  # or from kv_cache_memory_bytes / the devices
    kv_cache_memory_bytes: int | None = None
    # of each device's memory, when neither is given; None: the backend's
    memory_utilization: float | None = 0.9
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    devices: tuple[int, ...] | None = None  # ids; default the first tensor_parallel_size
    speculative_config: str | None = None  # vLLM's JSON (engine.core.speculation)
    quantization: str = "none"  # "int8": weights per output channel (engine.quant)
    kv_cache_dtype: str = "auto"  # pages' dtype (engine.attention.kv_dtype)
    async_scheduling: bool = True  # the loop plans step N + 1 while step N runs
    prefill_only: bool = False  # a disaggregated core's prefill set (engine.core.disaggregated)
    attention: str = "auto"  # engine.types.ATTENTION_BACKENDS ("reference": the definition)
    max_loras: int = 0  # LoRA adapters resident at once (engine.lora); 0: LoRA off
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept as host arrays (None: max_loras)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, folder) loaded at start

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give at most one of num_pages and kv_cache_memory_bytes")
        for name in (
            "max_num_seqs", "max_num_batched_tokens", "chunk_size", "decode_chunk_size",
            "page_size",
        ):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention must be one of {list(ATTENTION_BACKENDS)}, got {self.attention!r}"
            )
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_loras == 0 and self.lora_modules:
            raise ValueError("LoRA modules need max_loras >= 1 (--enable-lora)")
        if self.max_loras:
            LoraConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # its checks
        if self.devices is not None and len(self.devices) != self.tensor_parallel_size:
            raise ValueError(
                f"devices {list(self.devices)} must be tensor_parallel_size "
                f"({self.tensor_parallel_size}) ids"
            )

    def to_fields(self) -> dict[str, Any]:
        """JSON-ready fields (the core process's command line, a multi-host Setup)."""
        fields = dataclasses.asdict(self)
        fields["model_path"] = str(self.model_path)
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> CoreConfig:
        """The config `to_fields` gave, checked again."""
        fields = dict(fields)
        if fields.get("devices") is not None:
            fields["devices"] = tuple(fields["devices"])
        fields["lora_modules"] = tuple(tuple(m) for m in fields.get("lora_modules", ()))
        return cls(**fields)

    @property
    def lora(self) -> LoraConfig | None:
        if self.max_loras == 0:
            return None
        return LoraConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        text = self.speculative_config
        return None if text is None else SpeculativeConfig.parse(text)

    def model_len(self, cfg: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        return self.max_model_len


@dataclass
class SchedulerConfig:
    """The bounds one scheduler plans within (engine.core.scheduler)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunk_size: int  # prompt positions per chunk, a multiple of the page size
    max_prefill_seqs: int = 0  # prompt chunks per step (0: as many as the budget takes)
    vocab_size: int = 0  # for allowed_token_ids' masks (0: no masks)
    speculative: SpeculativeConfig | None = None  # drafts for decode rows (None: none)
    max_loras: int = 0  # LoRA adapters resident at once (engine.core.lora_slots)
    # a disaggregated core's prefill set: prompts only; a sequence leaves for the decode
    # set once its first token is sampled (Scheduler.take_handoffs)
    prefill_only: bool = False
    # the attention backend gives a query the same bits whether its sequence runs as a
    # decode row or in any chunk (Attention.any_form_bits): a prefix hit may then end
    # anywhere, one position short of the prompt too
    any_form_hits: bool = False
    # prompt positions per chunk in a step with decode rows (0: chunk_size); a chunk then
    # begins wherever the last one ended, so only with any_form_hits
    decode_chunk_size: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunk_size {self.chunk_size} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        if self.max_prefill_seqs < 0:
            raise ValueError(f"max_prefill_seqs must be >= 0, got {self.max_prefill_seqs}")
        if not 0 <= self.decode_chunk_size <= self.chunk_size:
            raise ValueError(
                f"decode_chunk_size must be in [0, chunk_size {self.chunk_size}], "
                f"got {self.decode_chunk_size}"
            )
        if self.decode_chunk_size not in (0, self.chunk_size) and not self.any_form_hits:
            raise ValueError("a smaller chunk beside decode rows needs any_form_hits")
        if self.prefill_only and self.speculative is not None:
            raise ValueError("a prefill-only scheduler does not speculate")
        if self.max_prefill_seqs == 0:
            self.max_prefill_seqs = self.max_num_batched_tokens
