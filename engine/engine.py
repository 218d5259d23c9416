"""The slot engine: a checkpoint's model behind prefill -> insert -> generate.

Runs on: whichever thread calls it (the orchestrator's stages). Owns: params
placed on the mesh and the jitted functions, compiled once per shape; the
decode state is passed in and out (donated), never kept here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.checkpoint import NP_DTYPES as DTYPES
from engine.config import ModelConfig, load_model_config, tensor_parallel
from engine.mesh import default_mesh, mesh_of, place_params, replicated, split, state_shardings
from engine.model import (
    WEIGHTS_LEFT_ROWS,
    last_logits,
    logits_of,
    prefill_chunk_hidden,
    prefill_forward,
    prefill_hidden,
)
from engine.prefix_cache import PREFIX_BLOCK, PrefixPool
from engine.sampling import SamplingArrays, host_arrays, mask_words, sample, top_logprobs
from engine.state import (
    DecodeState,
    decode_step,
    empty_state,
    free_slot,
    insert_prefix,
    write_masks,
)
from engine.types import (
    MAX_LOGPROBS,
    CacheStats,
    EngineLimits,
    Prefix,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
MIN_BUCKET = 16
ATTENTION_CHUNKS = 8  # chunks of the cache, while a chunk stays within MAX_CHUNK positions
MAX_CHUNK = 256
MAX_CHUNKS = 64
# Chunks run beside decode steps (engine.stages.queues.StepClock), sharing XLA's CPU
# threads: a step that waits behind one of a chunk's large ops stalls for it. Streams on the
# 100m model, 8 decoding while a 1,536-token prompt came in: inter-token p99 over p50
# 3.1-4.2x with chunks of 512, 2.0-2.2x with 256 and 128 (one run of 256: 3.9x).
DEFAULT_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class EngineConfig:
    """What to load and the fixed shapes to serve it with."""

    model_path: str | Path
    dtype: str = "float32"
    max_slots: int = 8
    max_model_len: int | None = None
    prefill_buckets: tuple[int, ...] | None = None
    max_prefill_len: int | None = None
    # Prompts one prefill call may take (1: no batching); with max_prefill_batch_tokens,
    # 16 prompts of 128 tokens, vLLM's CPU token budget per scheduler step (2048).
    max_prefill_batch: int = 16
    max_prefill_batch_tokens: int = 2048  # rows x bucket of one batched prefill call
    # Prompts longer than the largest bucket are prefilled this many tokens a call, on top
    # of the KV of the chunks before (None: no chunking; buckets then reach the context).
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK
    # Blocks of PREFIX_BLOCK prompt tokens whose KV is kept for later prompts that start
    # the same way (0: no prefix cache).
    prefix_cache_blocks: int = 0
    # The decode cache, prompt buffers and prefix pool together must fit this many bytes
    # (None: no cap); with it, prefix_cache_blocks -1 takes what the other two leave.
    kv_cache_memory_bytes: int | None = None
    # Devices: the first `tensor_parallel_size` of jax.devices(), or these ids (as many).
    tensor_parallel_size: int = 1
    devices: tuple[int, ...] | None = None
    # Decode steps' logits from a (vocab, hidden) copy of the head, as (vocab, rows)
    # (engine.model.step_logits). None: on the CPU backend in float32 when every device
    # holds the whole head.
    vocab_major_head: bool | None = None
    # Layer products of 2-63 rows (decode steps, short prompts) as weight x rows^T
    # (engine.model.project). None: on the CPU backend.
    weights_left: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_prefill_len is not None and self.max_prefill_len < 1:
            raise ValueError(f"max_prefill_len must be >= 1, got {self.max_prefill_len}")
        if self.prefix_cache_blocks < -1 or (
            self.prefix_cache_blocks == -1 and self.kv_cache_memory_bytes is None
        ):
            raise ValueError(
                f"prefix_cache_blocks must be >= 0 (or -1 with kv_cache_memory_bytes: what the "
                f"budget leaves), got {self.prefix_cache_blocks}"
            )
        budget = self.kv_cache_memory_bytes
        if budget is not None and budget < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {budget}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.devices is not None and len(self.devices) != self.tensor_parallel_size:
            raise ValueError(
                f"devices {list(self.devices)} must be tensor_parallel_size "
                f"({self.tensor_parallel_size}) ids"
            )
        if self.prefill_chunk is not None and self.prefill_chunk < MIN_BUCKET:
            raise ValueError(f"prefill_chunk must be >= {MIN_BUCKET}, got {self.prefill_chunk}")
        for name in ("max_prefill_batch", "max_prefill_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_buckets is not None:
            buckets = tuple(self.prefill_buckets)
            if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(
                    f"prefill_buckets must be positive and strictly increasing, got {buckets}"
                )


def default_buckets(max_prefill_len: int) -> tuple[int, ...]:
    """Powers of two from 16, ending with max_prefill_len itself."""
    buckets, size = [], MIN_BUCKET
    while size < max_prefill_len:
        buckets.append(size)
        size *= 2
    buckets.append(max_prefill_len)
    return tuple(buckets)


# The layers' products take one form from WEIGHTS_LEFT_ROWS rows up and another below
# (engine.model.project), and XLA:CPU's kernels round float32 sums differently by form. A
# prompt prefilled in a batch (M = rows x bucket in the layers' products) can give the
# same bits as alone (M = bucket) only when both M are on the same side; batch shapes are
# kept to those, and warm-up keeps of them only the ones where it measures the same bits
# (Engine._keep_exact_batch_shapes; tests/engine/test_prefill_batch.py checks every one).
SAME_KERNEL_ROWS = WEIGHTS_LEFT_ROWS


def prefill_batch_shapes(
    buckets: tuple[int, ...], max_batch: int, max_tokens: int
) -> tuple[tuple[int, int], ...]:
    """The (rows, bucket) shapes batched prefill may compile: rows 2, 4, ... max_batch,
    within max_tokens padded tokens a call (so a long bucket is prefilled alone), and only
    where a batched prompt's products take the form they take alone."""
    shapes = []
    rows = 2
    while rows <= max_batch:
        shapes += [
            (rows, b)
            for b in buckets
            if rows * b <= max_tokens and (b >= SAME_KERNEL_ROWS) == (rows * b >= SAME_KERNEL_ROWS)
        ]
        rows *= 2
    return tuple(sorted(shapes))


def vocab_major_head(config: EngineConfig, cfg: ModelConfig, mesh: Any) -> bool:
    """Whether decode steps take the vocab-major head (ModelConfig.vocab_major_head).

    A CPU-backend choice, measured in float32 only (in bfloat16 it was 1.4-1.6x slower
    at 2-8 rows of a 128k head): accelerators' matmuls take either layout. A head split
    over devices keeps one layout (the split is by vocabulary columns).
    """
    chosen = config.vocab_major_head
    if chosen is None:
        cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        return cpu and config.dtype == "float32" and cfg.head_shards == 1
    if chosen and cfg.head_shards > 1:
        raise ValueError("vocab_major_head needs the whole head on every device")
    return chosen


def decode_buckets(max_slots: int) -> tuple[int, ...]:
    """Batch sizes the generate step is compiled for: 1, 2, 4, ... and max_slots itself."""
    buckets = [1 << i for i in range(max_slots.bit_length()) if 1 << i < max_slots]
    return (*buckets, max_slots)


def attention_chunk(max_model_len: int) -> int:
    """Positions per KV-cache chunk: a power of two giving about ATTENTION_CHUNKS chunks,
    at most MAX_CHUNK positions while that takes at most MAX_CHUNKS chunks.

    A decode step reads the chunks up to the furthest busy slot, so a short
    context reads at most a chunk more than it holds; each chunk adds a few
    small ops (two conds per layer) to every step. Measured on the 128k
    model at max_model_len 4096 and a 128-token context: 32 slots stepped
    fastest with 256 positions (~10% ahead of 128 and 512), one slot 3-9%
    behind 512.
    """
    target = max(
        MIN_BUCKET,
        min(MAX_CHUNK, math.ceil(max_model_len / ATTENTION_CHUNKS)),
        math.ceil(max_model_len / MAX_CHUNKS),
    )
    return 1 << (target - 1).bit_length()


def resolve_shapes(
    config: EngineConfig, max_position_embeddings: int
) -> tuple[int, tuple[int, ...]]:
    """(max_model_len, prefill_buckets) after defaults, validated against each other."""
    max_len = config.max_model_len or min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len is not None and max_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"{max_position_embeddings}"
        )
    if config.prefill_buckets is not None:
        buckets = tuple(config.prefill_buckets)
    else:
        longest = min(config.max_prefill_len or max_len, max_len, config.prefill_chunk or max_len)
        buckets = default_buckets(longest)
    if buckets[-1] > max_len:
        raise ValueError(f"prefill bucket {buckets[-1]} exceeds max_model_len {max_len}")
    return max_len, buckets


class Engine:
    """Implements engine.types.EngineProtocol on a real JAX model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        cfg = load_model_config(config.model_path)
        if config.tensor_parallel_size > 1:
            cfg = tensor_parallel(cfg, config.tensor_parallel_size)
        self.mesh = (
            mesh_of(config.devices)
            if config.devices is not None
            else default_mesh(config.tensor_parallel_size)
        )
        cpu = all(d.platform == "cpu" for d in self.mesh.devices.flat)
        cfg = dataclasses.replace(
            cfg,
            vocab_major_head=vocab_major_head(config, cfg, self.mesh),
            weights_left=cpu if config.weights_left is None else config.weights_left,
        )
        self.model_config = cfg
        self.max_slots = config.max_slots
        self.max_model_len, self.prefill_buckets = resolve_shapes(
            config, cfg.max_position_embeddings
        )
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.vocab_size = cfg.vocab_size
        self.dtype = DTYPES[config.dtype]
        self._sharding = replicated(self.mesh)
        self.params = place_params(config.model_path, cfg, config.dtype, self.mesh)
        self._inv_freq = jax.device_put(cfg.rope_inv_freq(), self._sharding)
        eos = np.zeros((cfg.vocab_size,), bool)
        eos[[i for i in cfg.eos_token_ids if 0 <= i < cfg.vocab_size]] = True
        self._eos_mask = jax.device_put(eos, self._sharding)
        self._prefill = jax.jit(
            functools.partial(self._prefill_impl, cfg=cfg), static_argnames=("all_logits",)
        )
        self._resample = jax.jit(functools.partial(self._sample_first, eos_mask=self._eos_mask))
        self.prefill_batch_shapes = prefill_batch_shapes(
            self.prefill_buckets, config.max_prefill_batch, config.max_prefill_batch_tokens
        )
        self.max_prefill_batch = max((r for r, _ in self.prefill_batch_shapes), default=1)
        self._product_rows = self._shared_row_kernel(cfg)
        self._prefill_many = jax.jit(
            functools.partial(self._prefill_many_impl, cfg=cfg, product_rows=self._product_rows)
        )
        self.prefill_chunk = config.prefill_chunk if self._chunks_prompts(config) else None
        self.prefix_cache: PrefixPool | None = None
        self._piece_steps = self.prefill_chunk is not None or bool(config.prefix_cache_blocks)
        if self._piece_steps:
            # Pieces of a prompt computed on top of the KV before them: chunks of a long
            # prompt, and the rest of a prompt after a prefix-cache hit.
            self._piece = self.prefill_chunk or self.prefill_buckets[-1]
            capacity = self.max_prompt_len + self._piece  # a last piece may overhang the prompt
            self._chunk_capacity = -(-capacity // PREFIX_BLOCK) * PREFIX_BLOCK
            self._chunk_buffers = jax.jit(
                functools.partial(_prompt_buffers, cfg, self._chunk_capacity, self.dtype),
                out_shardings=split(self.mesh, 0),  # (kv heads, ...) per layer
            )
            self._chunk_step = jax.jit(
                functools.partial(self._chunk_impl, cfg=cfg),
                donate_argnums=(3, 4),
                static_argnames=("all_logits", "last"),
            )
        empty = functools.partial(
            empty_state,
            cfg,
            self.max_slots,
            self.max_model_len,
            self.dtype,
            attention_chunk(self.max_model_len),
        )
        blocks = self._budgeted_blocks(
            _bytes_of(jax.eval_shape(empty)),
            _bytes_of(jax.eval_shape(self._chunk_buffers)) if self._piece_steps else 0,
        )
        if blocks:
            pool_sharding = split(self.mesh, 1)  # (blocks, kv heads, ...) per layer
            self.prefix_cache = PrefixPool(
                cfg, blocks, self._chunk_capacity, self.dtype, pool_sharding
            )
        self._init_state = jax.jit(
            empty, out_shardings=state_shardings(jax.eval_shape(empty), self.mesh)
        )
        self._insert = jax.jit(insert_prefix, donate_argnums=(0,))
        self._free = jax.jit(free_slot, donate_argnums=(0,))
        self._set_masks = jax.jit(write_masks, donate_argnums=(0, 1))
        self.decode_buckets = decode_buckets(self.max_slots)
        self._generate = jax.jit(
            functools.partial(decode_step, cfg=cfg, max_len=self.max_model_len),
            donate_argnums=(1,),
            static_argnames=("rows",),
        )
        self.memory = {
            "decode_cache_bytes": _bytes_of(jax.eval_shape(self._init_state)),
            "prefix_cache_bytes": 0 if self.prefix_cache is None else self.prefix_cache.bytes,
            "prompt_buffer_bytes": (
                _bytes_of(jax.eval_shape(self._chunk_buffers)) if self._piece_steps else 0
            ),
        }
        logger.info(
            "engine ready: %s, %d slots, max_model_len %d, buckets %s, prefill chunk %s, "
            "device memory (bytes) %s, %s, %s head, weights-%s layer products",
            cfg.architecture,
            self.max_slots,
            self.max_model_len,
            self.prefill_buckets,
            self.prefill_chunk,
            self.memory,
            config.dtype,
            "vocab-major" if cfg.vocab_major_head else "hidden-major",
            "left" if cfg.weights_left else "right",
        )

    def _budgeted_blocks(self, decode_bytes: int, buffer_bytes: int) -> int:
        """The prefix pool's blocks, checked against (or, with -1, filling) the KV budget.

        A budget that cannot hold the decode cache and the prompt buffer, or not even one
        max-length request's share of them, is an error naming the sizes, at start.
        """
        config, cfg = self.config, self.model_config
        blocks, budget = config.prefix_cache_blocks, config.kv_cache_memory_bytes
        if budget is None:
            return blocks
        per_block = 2 * cfg.num_layers * cfg.kv_size * PREFIX_BLOCK * np.dtype(self.dtype).itemsize
        per_slot = decode_bytes // self.max_slots
        if per_slot + buffer_bytes > budget:
            raise ValueError(
                f"kv_cache_memory_bytes {budget} cannot hold one max-length request: its slot "
                f"of {self.max_model_len} positions takes {per_slot} bytes and the prompt "
                f"buffer {buffer_bytes}; raise the budget or lower max_model_len"
            )
        fixed = decode_bytes + buffer_bytes
        if fixed > budget:
            fit = (budget - buffer_bytes) // per_slot
            raise ValueError(
                f"kv_cache_memory_bytes {budget} is less than the decode cache of "
                f"{self.max_slots} slots ({decode_bytes} bytes) and the prompt buffer "
                f"({buffer_bytes}): at most {fit} slots of {self.max_model_len} positions fit"
            )
        if blocks == -1:
            return int((budget - fixed) // per_block)
        if fixed + blocks * per_block > budget:
            raise ValueError(
                f"kv_cache_memory_bytes {budget}: {blocks} prefix-cache blocks take "
                f"{blocks * per_block} bytes, {budget - fixed} are left after the decode cache "
                f"and the prompt buffer (at most {(budget - fixed) // per_block} blocks)"
            )
        return blocks

    def _shared_row_kernel(self, cfg: ModelConfig) -> int:
        """The most rows one prefill logits product takes (engine.model.last_logits): the
        largest row count n of batched prefill (2, 4, 8, ...) such that every row of a
        product of 2 to n rows has the bits it has alone (padded to 2), on these devices
        and params; 1 (a product per row) without batched prefill. Measured, not
        assumed: a backend may pick its kernel, or a row's place in it, by row count."""
        if self.max_prefill_batch < 2:
            return 1  # no batched prefill: one-row products are the fastest
        counts = sorted({2, *(rows for rows, _ in self.prefill_batch_shapes)})
        rng = np.random.default_rng(0)
        x = rng.standard_normal((counts[-1], cfg.hidden_size)).astype(self.params["embed"].dtype)
        rows = jax.device_put(x, self._sharding)
        one = jax.jit(functools.partial(last_logits, cfg=cfg, product_rows=2))  # padded to 2
        alone = np.stack([np.asarray(one(self.params, rows[i : i + 1]))[0] for i in range(len(x))])
        shared = 2
        for n in counts:
            product = jax.jit(functools.partial(last_logits, cfg=cfg, product_rows=n))
            if not np.array_equal(np.asarray(product(self.params, rows[:n])), alone[:n]):
                break
            shared = n
        if shared < counts[-1]:
            logger.info("prefill logits: products of at most %d rows (bits differ past)", shared)
        return shared

    def _chunks_prompts(self, config: EngineConfig) -> bool:
        """Chunking is on when asked for and some prompt would not fit the largest bucket."""
        longest = self.prefill_buckets[-1]
        return config.prefill_chunk is not None and longest < self.max_model_len - 1

    @property
    def max_prompt_len(self) -> int:
        if self._chunks_prompts(self.config):
            return self.max_model_len - 1
        return min(self.prefill_buckets[-1], self.max_model_len - 1)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_model_len, self.max_prompt_len, self.vocab_size)

    # -- pure functions behind the jits ------------------------------------------------------

    @staticmethod
    def _sample_first(last_logits: jax.Array, sampling: SamplingArrays, eos_mask: jax.Array) -> Any:
        """Sample the first generated token (key index 0, nothing generated yet)."""
        batched = jax.tree.map(lambda a: a[None], sampling)
        zero = jnp.zeros((1,), jnp.int32)
        counts = jnp.zeros((1, last_logits.shape[-1]), jnp.int32)
        out = sample(last_logits[None], batched, zero, counts, zero, eos_mask)
        return jax.tree.map(lambda a: a[0], out)

    def _prefill_impl(
        self,
        params: Any,
        tokens: jax.Array,
        length: jax.Array,
        sampling: SamplingArrays,
        inv_freq: jax.Array,
        eos_mask: jax.Array,
        *,
        cfg: Any,
        all_logits: bool,
    ) -> dict[str, Any]:
        logits, k, v = prefill_forward(
            params, tokens, length, inv_freq, cfg, all_logits, self._product_rows
        )
        last = logits[length - 1] if all_logits else logits[0]
        out = {
            "k": k,
            "v": v,
            "last_logits": last,
            "first": self._sample_first(last, sampling, eos_mask),
        }
        if all_logits:
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            nxt = jnp.roll(tokens, -1)
            out["prompt_chosen"] = jnp.take_along_axis(logprobs, nxt[:, None], axis=-1)[:, 0]
            out["prompt_top"] = top_logprobs(logprobs)
        return out

    @staticmethod
    def _prefill_many_impl(
        params: Any,
        tokens: jax.Array,
        lengths: jax.Array,
        sampling: SamplingArrays,
        inv_freq: jax.Array,
        eos_mask: jax.Array,
        *,
        cfg: Any,
        product_rows: int,
    ) -> dict[str, Any]:
        """Several prompts (rows, bucket) at once: each row's KV, last logits and first token."""
        hidden = functools.partial(prefill_hidden, cfg=cfg)
        x, k, v = jax.vmap(hidden, in_axes=(None, 0, None))(params, tokens, inv_freq)
        last_x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # (rows, 1, h)
        last = last_logits(params, last_x[:, 0], cfg, product_rows)  # as prefill alone has it
        rows = tokens.shape[0]
        zero = jnp.zeros((rows,), jnp.int32)
        counts = jnp.zeros((rows, last.shape[-1]), jnp.int32)
        first = sample(last, sampling, zero, counts, zero, eos_mask)
        # Split by row here, not on the host: eager slicing cost one dispatch per array
        # (rows x (2 x layers + 5) of them), ~10% of the prefill thread's time at 32 slots.
        return {
            "rows": [
                {
                    "k": tuple(layer[row] for layer in k),
                    "v": tuple(layer[row] for layer in v),
                    "last_logits": last[row],
                    "first": jax.tree.map(lambda a, row=row: a[row], first),
                }
                for row in range(rows)
            ]
        }

    def _chunk_impl(
        self,
        params: Any,
        tokens: jax.Array,
        offset: jax.Array,
        k_buf: tuple[jax.Array, ...],
        v_buf: tuple[jax.Array, ...],
        index: jax.Array,
        next_tokens: jax.Array,
        sampling: SamplingArrays,
        inv_freq: jax.Array,
        eos_mask: jax.Array,
        *,
        cfg: Any,
        all_logits: bool,
        last: bool,
    ) -> dict[str, Any]:
        """One chunk of a long prompt; the last one also samples the first token from the
        logits at `index` (the prompt's last position within the chunk)."""
        x, k_buf, v_buf = prefill_chunk_hidden(params, tokens, offset, k_buf, v_buf, inv_freq, cfg)
        out: dict[str, Any] = {"k": k_buf, "v": v_buf}
        if all_logits:
            logits = logits_of(params, x, cfg)
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            out["prompt_chosen"] = jnp.take_along_axis(logprobs, next_tokens[:, None], axis=-1)[
                :, 0
            ]
            out["prompt_top"] = top_logprobs(logprobs)
        if last:
            row = lax.dynamic_slice_in_dim(x, index, 1, axis=0)
            final = last_logits(params, row, cfg, self._product_rows)[0]
            out["last_logits"] = final
            out["first"] = self._sample_first(final, sampling, eos_mask)
        return out

    # -- EngineProtocol ----------------------------------------------------------------------

    def init_state(self) -> DecodeState:
        return self._init_state()

    def cache_stats(self) -> CacheStats:
        pool = self.prefix_cache
        memory = self.memory
        if pool is None:
            return CacheStats(**memory)
        index = pool.index
        return CacheStats(index.stats.queries, index.stats.hits, index.used, index.blocks, **memory)

    def bucket_for(self, length: int) -> int:
        self.limits.check(length, None)
        if length > self.prefill_buckets[-1]:
            raise ValueError(f"a {length}-token prompt is past the largest bucket: chunked")
        return next(b for b in self.prefill_buckets if b >= length)

    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_logprobs: int | None = None,
        between_chunks: Callable[[], None] | None = None,
    ) -> Prefix:
        """`prompt_logprobs` k: each prompt position's logprob and its top k alternatives."""
        length = len(token_ids)
        if length == 0:
            raise ValueError("the prompt must have at least one token")
        top_k, prompt_logprobs = prompt_logprobs or 0, prompt_logprobs is not None
        pool = None if prompt_logprobs else self.prefix_cache  # they need every position
        if pool is not None:
            blocks = pool.index.lookup(token_ids)
            if blocks:
                prefix = self._prefill_pieces(
                    token_ids, sampling, False, between_chunks, pool.load(blocks)
                )
                pool.store(token_ids, prefix.cache, cached=len(blocks))
                return prefix
        if length > self.prefill_buckets[-1] and self.prefill_chunk is not None:
            prefix = self._prefill_pieces(
                token_ids, sampling, prompt_logprobs, between_chunks, top_k=top_k
            )
        else:
            prefix = self._prefill_bucket(token_ids, sampling, prompt_logprobs, top_k)
        if pool is not None:
            pool.store(token_ids, prefix.cache, cached=0)
        return prefix

    def _prefill_bucket(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        prompt_logprobs: bool,
        top_k: int = 0,
    ) -> Prefix:
        length = len(token_ids)
        bucket = self.bucket_for(length)
        padded = np.zeros((bucket,), np.int32)
        padded[:length] = self._checked_ids(token_ids)
        out = self._prefill(
            self.params,
            padded,
            np.int32(length),
            host_arrays(sampling, self.vocab_size),
            self._inv_freq,
            self._eos_mask,
            all_logits=prompt_logprobs,
        )
        prefix = _new_prefix(
            length, sampling, out["first"], (out["k"], out["v"]), out["last_logits"]
        )
        if prompt_logprobs:
            prefix.prompt_logprobs = _prompt_logprobs(
                token_ids, out["prompt_chosen"], out["prompt_top"], top_k
            )
        return prefix

    def _pieces(self, start: int, length: int, whole: bool) -> list[tuple[int, int]]:
        """(offset, size) of the calls prefilling positions start..length-1: full chunks,
        then the smallest bucket that holds the rest (`whole`: full chunks only, the
        shapes prompt logprobs are compiled for)."""
        pieces, offset = [], start
        while length - offset > self._piece:
            pieces.append((offset, self._piece))
            offset += self._piece
        rest = length - offset
        size = self._piece if whole else min(b for b in self.piece_sizes if b >= rest)
        return [*pieces, (offset, size)]

    @property
    def piece_sizes(self) -> tuple[int, ...]:
        """The sizes a prompt's last piece is compiled for."""
        return tuple(sorted({b for b in self.prefill_buckets if b <= self._piece} | {self._piece}))

    def _prefill_pieces(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        prompt_logprobs: bool,
        between_chunks: Callable[[], None] | None,
        loaded: tuple[int, Any] | None = None,
        top_k: int = 0,
    ) -> Prefix:
        """A prompt in pieces on top of the KV before them: a prompt past the largest bucket
        `prefill_chunk` tokens a call, or what follows a prefix-cache hit (`loaded`: the
        number of cached positions and the buffers holding them).

        Each piece is finished before the next is sent, and `between_chunks` runs
        in between (the prefill stage lets a decode step through there), so one
        long prompt holds the device for one chunk at a time.
        """
        self.limits.check(len(token_ids), None)
        length = len(token_ids)
        ids = np.zeros((self._chunk_capacity + 1,), np.int32)
        ids[:length] = self._checked_ids(token_ids)
        start, (k_buf, v_buf) = loaded if loaded is not None else (0, self._chunk_buffers())
        arrays = host_arrays(sampling, self.vocab_size)
        chosen, top_lp, top_ids = [], [], []
        pieces = self._pieces(start, length, whole=prompt_logprobs)
        for offset, chunk in pieces:
            last = offset + chunk >= length
            out = self._chunk_step(
                self.params,
                ids[offset : offset + chunk],
                np.int32(offset),
                k_buf,
                v_buf,
                np.int32(length - 1 - offset),
                ids[offset + 1 : offset + chunk + 1],
                arrays,
                self._inv_freq,
                self._eos_mask,
                all_logits=prompt_logprobs,
                last=last,
            )
            k_buf, v_buf = out["k"], out["v"]
            if prompt_logprobs:
                chosen.append(out["prompt_chosen"])
                top_lp.append(out["prompt_top"][0])
                top_ids.append(out["prompt_top"][1])
            if not last and between_chunks is not None:
                jax.block_until_ready(k_buf)
                between_chunks()
        prefix = _new_prefix(length, sampling, out["first"], (k_buf, v_buf), out["last_logits"])
        if prompt_logprobs:
            prefix.prompt_logprobs = _prompt_logprobs(
                token_ids,
                jnp.concatenate(chosen),
                (jnp.concatenate(top_lp), jnp.concatenate(top_ids)),
                top_k,
            )
        return prefix

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens a prefill would now find in the prefix cache (0 without one)."""
        pool = self.prefix_cache
        return 0 if pool is None else pool.index.peek(token_ids) * PREFIX_BLOCK

    def prefill_parts(self, token_ids: Sequence[int]) -> int:
        """Device calls prefill(token_ids) would now make (EngineProtocol.prefill_parts)."""
        start, length = self.cached_tokens(token_ids), len(token_ids)
        if start or (length > self.prefill_buckets[-1] and self.prefill_chunk is not None):
            return len(self._pieces(start, length, whole=False))  # as prefill() takes them
        return 1

    def batch_fits(self, lengths: Sequence[int]) -> bool:
        """Whether these prompts make one batched prefill call: one bucket, a compiled shape."""
        if len(lengths) < 2:
            return True
        if max(lengths) > self.prefill_buckets[-1]:  # chunked or too long: prefilled alone
            return False
        buckets = {self.bucket_for(n) for n in lengths}
        if len(buckets) != 1:
            return False
        bucket = buckets.pop()
        return any(r >= len(lengths) and b == bucket for r, b in self.prefill_batch_shapes)

    def prefill_batch(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[Prefix]:
        """Prefill several prompts in one call (padded to a compiled (rows, bucket) shape).

        Each Prefix is what `prefill` gives the prompt alone (tests/engine hold them to it).
        """
        if len(prompts) == 1:
            ids, sampling = prompts[0]
            return [self.prefill(ids, sampling)]
        lengths = [len(ids) for ids, _ in prompts]
        if not self.batch_fits(lengths):
            raise ValueError(f"prompts of lengths {lengths} do not fit one batched prefill")
        bucket = self.bucket_for(max(lengths))
        rows = min(r for r, b in self.prefill_batch_shapes if b == bucket and r >= len(prompts))
        padded = np.zeros((rows, bucket), np.int32)
        true_lengths = np.ones((rows,), np.int32)  # padding rows: one token, discarded
        for row, (ids, _) in enumerate(prompts):
            padded[row, : len(ids)] = self._checked_ids(ids)
            true_lengths[row] = len(ids)
        samplings = [host_arrays(s, self.vocab_size) for _, s in prompts]
        samplings += [samplings[0]] * (rows - len(prompts))
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *samplings)
        out = self._prefill_many(
            self.params, padded, true_lengths, stacked, self._inv_freq, self._eos_mask
        )
        prefixes = [
            Prefix(
                length=length,
                sampling=sampling,
                token=piece["first"].token,
                logprob=piece["first"].logprob,
                top_ids=piece["first"].top_ids,
                top_logprobs=piece["first"].top_logprobs,
                cache=(piece["k"], piece["v"]),
                last_logits=piece["last_logits"],
            )
            for length, (_, sampling), piece in zip(lengths, prompts, out["rows"], strict=False)
        ]
        if self.prefix_cache is not None:  # prompts batched together look nothing up
            for (ids, _), prefix in zip(prompts, prefixes, strict=True):
                self.prefix_cache.store(ids, prefix.cache, cached=0)
        return prefixes

    def resample(self, prefix: Prefix, sampling: SamplingParams) -> Prefix:
        first = self._resample(prefix.last_logits, host_arrays(sampling, self.vocab_size))
        return dataclasses.replace(
            prefix,
            sampling=sampling,
            token=first.token,
            logprob=first.logprob,
            top_ids=first.top_ids,
            top_logprobs=first.top_logprobs,
        )

    def close(self) -> None:
        """Nothing beyond device memory to release: the arrays go with the engine."""

    def receive(self, prefix: Prefix) -> Prefix:
        """A prefix prefilled by another engine, moved onto this one's devices in the
        layouts its own prefill gives (KV split by kv head, the first token copied), so
        inserting it compiles nothing new. Waits for the copy: the caller is the transfer
        thread, and the generate thread then never waits on one."""
        cache = jax.device_put(prefix.cache, split(self.mesh, 0))
        first = jax.device_put(
            (prefix.token, prefix.logprob, prefix.top_ids, prefix.top_logprobs), self._sharding
        )
        jax.block_until_ready((cache, first))
        token, logprob, top_ids, top_logprobs = first
        return dataclasses.replace(
            prefix,
            token=token,
            logprob=logprob,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            cache=cache,
            last_logits=None,  # resampling happens on the prefill side
        )

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        self._check_slot(slot)
        k, v = prefix.cache
        return self._insert(
            state,
            np.int32(slot),
            k,
            v,
            np.int32(prefix.length),
            prefix.token,
            host_arrays(prefix.sampling, self.vocab_size),
        )

    def decode_bucket(self, busy_rows: int) -> int:
        """The smallest decode bucket covering slots 0..busy_rows-1."""
        if not 1 <= busy_rows <= self.max_slots:
            raise ValueError(f"busy_rows must be in 1..{self.max_slots}, got {busy_rows}")
        return next(b for b in self.decode_buckets if b >= busy_rows)

    def generate(
        self, state: DecodeState, batch: int | None = None
    ) -> tuple[DecodeState, StepOutput]:
        state, step, _ = self._step(state, batch)
        return state, step

    def generate_with_logits(
        self, state: DecodeState, batch: int | None = None
    ) -> tuple[DecodeState, StepOutput, Any]:
        """generate() plus the step's raw logits (batch, vocab), for tests and debugging (a
        vocab-major step's are transposed on the host: nothing to compile)."""
        state, step, logits = self._step(state, batch)
        return state, step, np.asarray(logits).T if self.model_config.vocab_major_head else logits

    def _step(self, state: DecodeState, batch: int | None) -> tuple[DecodeState, StepOutput, Any]:
        """One decode step; its logits in the step's own layout (never transposed here: the
        generate loop drops them)."""
        rows = self.max_slots if batch is None else batch
        if rows not in self.decode_buckets:
            raise ValueError(f"batch must be one of the decode buckets {self.decode_buckets}")
        state, out, active, logits = self._generate(
            self.params, state, self._inv_freq, self._eos_mask, rows=rows
        )
        return (
            state,
            StepOutput(out.token, out.logprob, out.top_ids, out.top_logprobs, active),
            logits,
        )

    def free(self, state: DecodeState, slot: int) -> DecodeState:
        self._check_slot(slot)
        return self._free(state, np.int32(slot))

    def set_masks(self, state: DecodeState, slots: Any, allowed: Any) -> DecodeState:
        """Structured outputs: each constrained slot's mask for its next token (see
        EngineProtocol.set_masks); one fixed shape, compiled by warm-up."""
        words = state.sampling.allowed.shape[1]
        slots = np.asarray(slots, np.int32)
        allowed = np.asarray(allowed, np.int32)
        if slots.shape != (self.max_slots,) or allowed.shape != (self.max_slots, words):
            raise ValueError(f"set_masks takes ({self.max_slots},) slots, masks of {words} words")
        sampling = state.sampling
        rows, masked = self._set_masks(sampling.allowed, sampling.masked, slots, allowed)
        return dataclasses.replace(state, sampling=sampling._replace(allowed=rows, masked=masked))

    def warmup(self, prefill: bool = True, generate: bool = True) -> None:
        """Compile every shape serving can meet: each bucket (both variants), insert, and the
        step at each decode bucket.

        In disaggregated mode each engine warms its own part: generate=False compiles no
        decode state, insert or step; prefill=False no prefill, but inserting a prefix
        of every cache shape as the transfer stage delivers them (through receive).
        """
        sampling = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=0, logprobs=1)
        if prefill:
            prefixes = self._warm_prefill(sampling)
        else:
            prefixes = [self.receive(prefix) for prefix in self._blank_prefixes(sampling)]
        if not generate:
            jax.block_until_ready([prefix.token for prefix in prefixes])
            return
        state = self.init_state()
        for prefix in prefixes:
            state = self.insert(prefix, state, 0)
        for batch in self.decode_buckets:
            state, out = self.generate(state, batch)
        nowhere = np.full((self.max_slots,), self.max_slots, np.int32)  # padding rows only
        every_token = np.full((self.max_slots, mask_words(self.vocab_size)), -1, np.int32)
        state = self.set_masks(state, nowhere, every_token)
        state = self.free(state, 0)
        jax.block_until_ready((state, out))

    def _warm_prefill(self, sampling: SamplingParams) -> list[Prefix]:
        """Compile every prefill shape; one prefix of each cache shape, to warm insert with."""
        prefixes = []
        for bucket in self.prefill_buckets:
            length = min(bucket, self.max_prompt_len)
            self.prefill([0] * length, sampling, prompt_logprobs=True)
            prefixes.append(self.prefill([0] * length, sampling))
        self.resample(prefixes[-1], sampling)
        self._keep_exact_batch_shapes(sampling)
        if self.prefill_chunk is not None or self.prefix_cache is not None:
            prefixes += self._warm_pieces(sampling)
        return prefixes

    def _keep_exact_batch_shapes(self, sampling: SamplingParams) -> None:
        """Compile the batched prefill shapes and keep those where a prompt gets the bits
        it gets alone (the first token and last logits of every row of a batch of one
        random prompt). Measured, not assumed: XLA:CPU picks its kernels by row count,
        and where the rule of SAME_KERNEL_ROWS held on one 2-core machine, another's
        (AVX-512) rounded a 16- or 32-token prompt otherwise in every batch."""
        pool, self.prefix_cache = self.prefix_cache, None  # nothing of this is kept
        kept: list[tuple[int, int]] = []
        dropped: list[tuple[int, int]] = []
        try:
            rng = np.random.default_rng(0)
            for rows, bucket in self.prefill_batch_shapes:
                length = min(bucket, self.max_prompt_len)
                prompt = rng.integers(0, self.vocab_size, length).tolist()
                alone = self._prefill_bucket(prompt, sampling, False)
                want = np.asarray(alone.last_logits), int(alone.token)
                batched = self.prefill_batch([(prompt, sampling)] * rows)
                same = all(
                    np.array_equal(np.asarray(p.last_logits), want[0]) and int(p.token) == want[1]
                    for p in batched
                )
                (kept if same else dropped).append((rows, bucket))
        finally:
            self.prefix_cache = pool
        if dropped:
            logger.info("batched prefill shapes %s dropped: a prompt's bits differ there", dropped)
        self.prefill_batch_shapes = tuple(kept)
        self.max_prefill_batch = max((r for r, _ in kept), default=1)

    def _blank_prefixes(self, sampling: SamplingParams) -> list[Prefix]:
        """Host prefixes of every cache shape this engine's prefill gives, zeros throughout."""
        cfg = self.model_config
        lengths = sorted({min(b, self.max_prompt_len) for b in self.prefill_buckets})
        if self._piece_steps:
            lengths.append(self._chunk_capacity)
        kv, dim = cfg.num_kv_heads, cfg.head_dim
        out = []
        for length in lengths:
            keys = tuple(np.zeros((kv, dim, length), self.dtype) for _ in range(cfg.num_layers))
            values = tuple(np.zeros((kv, length, dim), self.dtype) for _ in range(cfg.num_layers))
            alternatives = np.zeros((MAX_LOGPROBS,), np.float32)
            out.append(
                Prefix(
                    length=1,
                    sampling=sampling,
                    token=np.int32(0),
                    logprob=np.float32(0.0),
                    top_ids=np.zeros((MAX_LOGPROBS,), np.int32),
                    top_logprobs=alternatives,
                    cache=(keys, values),
                    last_logits=None,
                )
            )
        return out

    def _warm_pieces(self, sampling: SamplingParams) -> list[Prefix]:
        """Compile the piece steps (every last-piece size, a middle chunk, the logprob
        shapes), and the prefix pool's load and its store from every cache shape, without
        putting anything in the pool."""
        pool, self.prefix_cache = self.prefix_cache, None
        prefixes = []
        try:
            if self.prefill_chunk is not None:
                length = min(self.prefill_buckets[-1] + self._piece + 1, self.max_prompt_len)
                self.prefill([0] * length, sampling, prompt_logprobs=True)
                prefixes.append(self.prefill([0] * length, sampling))  # middle chunks too
            for size in self.piece_sizes:
                start = max(0, min(self._piece, self.max_prompt_len - size))
                length = min(start + size, self.max_prompt_len)
                loaded = (start, self._chunk_buffers())
                prefixes.append(self._prefill_pieces([0] * length, sampling, False, None, loaded))
            if pool is not None:
                pool.warm(self._chunk_buffers())
                for bucket in self.prefill_buckets:
                    ids = [0] * min(bucket, self.max_prompt_len)
                    pool.warm(self._prefill_bucket(ids, sampling, False).cache)
        finally:
            self.prefix_cache = pool
        return prefixes

    def _checked_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise ValueError(f"token id {bad} is out of the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in 0..{self.max_slots - 1}, got {slot}")


def _prompt_logprobs(
    token_ids: Sequence[int], chosen: jax.Array, top: tuple[jax.Array, jax.Array], n: int
) -> list[TokenLogprobs | None]:
    """Host list: None, then for position i the logprob of token i given tokens < i."""
    chosen_np = np.asarray(chosen)
    top_lp, top_ids = (np.asarray(a) for a in top)
    result: list[TokenLogprobs | None] = [None]
    for i in range(1, len(token_ids)):
        alternatives = tuple((int(top_ids[i - 1, j]), float(top_lp[i - 1, j])) for j in range(n))
        result.append(TokenLogprobs(int(token_ids[i]), float(chosen_np[i - 1]), alternatives))
    return result


def _bytes_of(shapes: Any) -> int:
    """Bytes of every array in a pytree of shapes (jax.eval_shape's)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))


def _new_prefix(
    length: int, sampling: SamplingParams, first: Any, cache: Any, last_logits: Any
) -> Prefix:
    """A Prefix from a prefill's sampled first token (`first`: Sampled), KV and logits."""
    return Prefix(
        length=length,
        sampling=sampling,
        token=first.token,
        logprob=first.logprob,
        top_ids=first.top_ids,
        top_logprobs=first.top_logprobs,
        cache=cache,
        last_logits=last_logits,
    )


def _prompt_buffers(
    cfg: Any, capacity: int, dtype: Any
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Empty per-layer KV of one prompt of up to `capacity` positions, in prefill's layouts."""
    layers = range(cfg.num_layers)
    k = tuple(jnp.zeros((cfg.num_kv_heads, cfg.head_dim, capacity), dtype) for _ in layers)
    v = tuple(jnp.zeros((cfg.num_kv_heads, capacity, cfg.head_dim), dtype) for _ in layers)
    return k, v
