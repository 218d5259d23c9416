"""The engine core: a scheduler and a runner for one device set, advanced one step a call.

Runs on: one thread, the core's loop (nano-vllm's `step`, vLLM V1's EngineCore). Owns
the scheduler and the runner it builds from a checkpoint and a `CoreConfig`. Receives
sequences (`add`, `abort`); emits each step's `Emitted` tokens.

Params are placed on a mesh of `tensor_parallel_size` devices (GSPMD: heads, kv heads,
the MLP and the vocabulary split over its "model" axis); the KV cache gets its pages
from engine.core.memory (a byte budget, a page count, or what the devices have left).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine import row_dot
from engine.attention import KVLayout, attention_backend, attention_layout
from engine.attention.kv_dtype import storage_dtype
from engine.config import ModelConfig, load_model_config, tensor_parallel
from engine.core.config import CoreConfig, SchedulerConfig
from engine.core.defaults import BACKEND_DEFAULTS, defaults_for
from engine.core.draft import DraftProposer, build_draft, draft_config
from engine.core.memory import KVBudget, pages_for_budget
from engine.core.messages import Stats
from engine.core.pages import PagePool, PageStats
from engine.core.runner import Launched, Runner, StepPlan
from engine.core.scheduler import Emitted, Scheduler, SequenceState
from engine.core.speculation import SpecCounters
from engine.lora import Adapters, empty_pool, with_pool, write_slot, zero_slot
from engine.mesh import default_mesh, mesh_of, place_checkpoint_params
from engine.model import Params
from engine.paged_model import hidden_major_head
from engine.quant import param_bytes, quantize_params
from engine.types import EngineLimits

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self, config: CoreConfig, agree_pages: Callable[[Callable[[], int]], int] | None = None
    ) -> None:
        """`agree_pages`: multi-host (engine.multihost), given how this process would count
        its pages, the count every process uses (process 0 counts; the others are told)."""
        cfg = load_model_config(config.model_path)
        if config.tensor_parallel_size > 1:
            cfg = tensor_parallel(cfg, config.tensor_parallel_size)
        self.config = config
        self.model_config = cfg
        max_len = config.model_len(cfg)
        self.max_model_len = max_len
        self.mesh = (
            mesh_of(config.devices)
            if config.devices is not None
            else default_mesh(config.tensor_parallel_size)
        )
        platform = self.mesh.devices.flat[0].platform
        chunk_size, batched = backend_shapes(config, platform)
        defaults = defaults_for(platform)
        page_size = self.page_size = config.page_size or defaults.page_size
        config = self.config = replace(
            config,
            chunk_size=chunk_size,
            max_num_batched_tokens=batched,
            page_size=page_size,
            memory_utilization=config.memory_utilization or defaults.memory_utilization,
        )
        cfg = self.model_config = backend_numerics(cfg, platform)
        fold = 128 // cfg.head_dim if platform == "tpu" and cfg.head_dim < 128 else 1
        kv_dtype = storage_dtype(config.kv_cache_dtype, config.dtype)
        bits = platform == "cpu"  # KVLayout.bits: XLA:CPU's 16/8-bit float scatters
        probe = attention_layout(
            KVLayout(1, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, fold, bits),
            platform,
            config.attention,
        )
        # A chunk fits beside every decode row, so a prompt never waits for them to end.
        room = batched - config.max_num_seqs
        chunk = max(page_size, min(chunk_size, room))
        chunk -= chunk % page_size
        self.chunk_size = chunk
        params = self._params(config.model_path, cfg, platform)
        self.weight_bytes = param_bytes(params)
        self.adapters: Adapters | None = None
        if config.lora is not None:  # every adapter named at start read (and checked) now
            self.adapters = Adapters(cfg, config.lora, config.dtype)
            for name, folder in config.lora_modules:
                self.adapters.load(name, folder)
            params = with_pool(params, empty_pool(cfg, config.lora, config.dtype, self.mesh))
        spec = config.speculative
        draft_cfg, draft_params = None, None
        if spec is not None and spec.model is not None:  # placed before the pages are counted
            if agree_pages is not None:
                raise ValueError("a draft model is not supported with multi-host serving yet")
            draft_cfg = draft_config(spec.model, cfg, config.tensor_parallel_size)
            draft_cfg = backend_numerics(draft_cfg, platform)
            draft_params = self._params(spec.model, draft_cfg, platform)
            self.weight_bytes += param_bytes(draft_params)
        layers = cfg.num_layers  # a page holds every layer's K/V, the draft's layers' too
        if draft_cfg is not None:
            draft_probe = replace(
                probe, kv_heads=draft_cfg.num_kv_heads, head_dim=draft_cfg.head_dim
            )
            layers += -(-draft_cfg.num_layers * draft_probe.page_bytes // probe.page_bytes)
        budget = KVBudget(
            num_pages=config.num_pages,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            memory_utilization=config.memory_utilization or defaults.memory_utilization,
            default_pages=config.max_num_seqs * -(-max_len // page_size),
        )
        count = functools.partial(pages_for_budget, budget, probe, layers, self.mesh)
        num_pages = count() if agree_pages is None else agree_pages(count)
        layout = replace(probe, num_pages=num_pages)
        pool = PagePool(num_pages, page_size, prefix_caching=config.prefix_caching)
        self.draft: DraftProposer | None = None
        if draft_cfg is not None and draft_params is not None:
            self.draft = build_draft(
                draft_params,
                draft_cfg,
                replace(layout, kv_heads=draft_cfg.num_kv_heads, head_dim=draft_cfg.head_dim),
                self.mesh,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_len,
                max_num_batched_tokens=batched,
                chunk_size=chunk,
                max_prefill_seqs=config.max_prefill_seqs,
                attention_choice=config.attention,
            )
        attention = attention_backend(
            platform,
            layout.stacked(cfg.num_layers),
            self.mesh,
            chunk_size=chunk,
            max_prefill_seqs=config.max_prefill_seqs,
            choice=config.attention,
        )
        self.attention = attention
        any_form = attention.any_form_bits(cfg.num_heads)
        decode_chunk = config.decode_chunk_size or defaults.decode_chunk_size or chunk
        decode_chunk = max(page_size, min(decode_chunk, chunk))
        decode_chunk -= decode_chunk % page_size
        self.decode_chunk_size = decode_chunk if any_form else chunk
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                chunk_size=chunk,
                max_prefill_seqs=config.max_prefill_seqs,
                vocab_size=cfg.vocab_size,
                speculative=spec,
                prefill_only=config.prefill_only,
                max_loras=config.max_loras,
                any_form_hits=any_form,
                decode_chunk_size=self.decode_chunk_size,
            ),
            pool,
            self.draft,
        )
        self.runner = Runner(
            params,
            cfg,
            layout,
            attention,
            self.mesh,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=batched,
            eos_token_ids=cfg.eos_token_ids,
        )
        self.kv_cache_bytes = layout.page_bytes * num_pages * cfg.num_layers
        self.limits = EngineLimits(
            max_model_len=max_len, max_prompt_len=max_len - 1, vocab_size=cfg.vocab_size
        )
        logger.info(
            "engine core: %s on %d %s device(s), weights %s (%d bytes), %d pages of %d "
            "positions in %s (%d bytes of KV, %d max-length sequences), %d sequences, "
            "%d tokens a step, prompt chunks of %d, attention %s",
            cfg.architecture,
            self.mesh.devices.size,
            platform,
            config.quantization if config.quantization != "none" else config.dtype,
            self.weight_bytes,
            num_pages,
            page_size,
            kv_dtype,
            self.kv_cache_bytes,
            num_pages // -(-max_len // page_size),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            chunk,
            type(attention).__name__,
        )

    def _params(self, path: str | Path, cfg: ModelConfig, platform: str) -> Params:
        """A checkpoint's params placed on the mesh, quantized as configured, in the
        backend's head layout (CPU: hidden_major_head, XLA:CPU's faster head product,
        unless engine.row_dot reads it as stored)."""
        params = place_checkpoint_params(path, cfg, self.config.dtype, self.mesh)
        params = quantize_params(params, self.config.quantization)
        return hidden_major_head(params, cfg) if platform == "cpu" else params

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.model_config.eos_token_ids)

    def warmup(self) -> None:
        self.runner.warmup()
        if self.adapters is not None:  # compiles the slot write (an empty slot's zeros)
            self.runner.params = write_slot(self.runner.params, 0, zero_slot(self.runner.params))
        if self.draft is not None:
            self.draft.runner.warmup()  # its proposals' steps
            self.draft.runner.warmup_fill()  # following the target's

    def add(self, seq: SequenceState) -> None:
        if seq.adapter and self.adapters is None:
            raise ValueError("LoRA adapters are not enabled on this core (max_loras is 0)")
        self.scheduler.add(seq)

    def abort(self, seq_id: str) -> bool:
        return self.scheduler.abort(seq_id)

    def page_stats(self) -> PageStats:
        return self.scheduler.pool.stats()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def num_pages(self) -> int:
        return self.scheduler.pool.num_pages

    def stats(self, steps: int) -> Stats:
        """The gauges and counters sent with each step's outputs."""
        scheduler = self.scheduler
        pages = scheduler.pool.stats()
        spec = SpecCounters() if scheduler.speculator is None else scheduler.speculator.counters
        return Stats(
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
            pages_total=pages.total,
            pages_free=pages.free,
            pages_cached=pages.cached,
            steps=steps,
            prefix_queries=scheduler.prefix_queries,
            prefix_hits=scheduler.prefix_hits,
            preemptions=scheduler.preemptions,
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """vLLM's lora_requests_info: adapters running, waiting, and the pool's slots."""
        if self.adapters is None:
            return {}
        named = self.adapters.name_of
        waiting = sorted({s.adapter for s in self.scheduler.waiting} - {0})
        return {
            "lora_running": tuple(named(a) for a in self.scheduler.lora.running()),
            "lora_waiting": tuple(named(a) for a in waiting),
            "max_loras": self.config.max_loras,
        }

    def step(self) -> list[Emitted]:
        """One scheduled step run on the devices; [] when there is nothing to run."""
        pending = self.launch()
        return [] if pending is None else self.finish(pending)

    def launch(self, ahead: bool = False) -> Pending | None:
        """Plan the next step and dispatch it; returns at once, the devices still running
        (None: nothing to run). Steps are finished in the order they were launched.
        `ahead`: one step is in flight; plan the next from what it will leave, its
        sampled tokens fed on the device (None also when that cannot be planned yet:
        finish the one in flight first)."""
        plan = self.scheduler.schedule(ahead)
        if plan is None:
            return None
        for slot, adapter in plan.lora_writes:
            assert self.adapters is not None
            arrays = self.adapters.arrays(adapter)
            self.runner.params = write_slot(self.runner.params, slot, arrays)
        launched = self.runner.execute(self.runner.prepare(plan))
        if self.draft is not None:
            self.draft.follow(plan)
        return Pending(plan, launched)

    def finish(self, pending: Pending) -> list[Emitted]:
        """Wait for a launched step and take its tokens."""
        result = self.runner.collect(pending.plan, pending.launched)
        return self.scheduler.update(pending.plan, result)


# A prompt chunk's positions per backend when the config leaves them to it
# (engine.core.defaults, the one table).
CHUNK_SIZE = {platform: d.chunk_size for platform, d in BACKEND_DEFAULTS.items()}


def backend_shapes(config: CoreConfig, platform: str) -> tuple[int, int]:
    """The chunk size (the backend's when the config gives None) and a step's token
    budget (a chunk beside every decode row when None)."""
    chunk = config.chunk_size or defaults_for(platform).chunk_size
    return chunk, config.max_num_batched_tokens or chunk + config.max_num_seqs


def backend_numerics(cfg: ModelConfig, platform: str) -> ModelConfig:
    """How the model computes on a backend (the reference forms elsewhere). TPU: XLA's
    own row reduce (its order follows the reduced axis, not the rows), where each level
    of engine.rowwise's tree is a pass over memory; and RoPE's rotation as a product,
    where half-width slices are padded copies (an 8B prompt's prefill at TP 4: 1.83x the
    unavoidable bytes with both reference forms, 1.49x without them; bench/README); the
    row-parallel products' partials in the model's dtype (ModelConfig.partials_in_dtype);
    and the layers unrolled. XLA:CPU keeps the tree (its reduce gives a row other bits among
    16+ rows) and a loop over the layers (ModelConfig.scan_layers); with one device, its
    float32 products through engine.row_dot's kernel when it builds here
    (ModelConfig.row_products)."""
    if platform == "cpu":
        # one device: the kernel has no rule for splitting its operands
        kernel = cfg.shards == 1 and row_dot.available()
        return replace(cfg, row_products=kernel)
    if platform != "tpu":
        return cfg
    return replace(
        cfg,
        fixed_order_sums=False,
        rope_by_product=True,
        partials_in_dtype=True,
        scan_layers=False,
    )


@dataclass(frozen=True)
class Pending:
    """A step dispatched to the devices whose tokens the scheduler has not taken yet."""

    plan: StepPlan
    launched: Launched


__all__ = ["CoreConfig", "Emitted", "EngineCore", "Pending", "SequenceState"]
