"""The Llama-family decoder as pure functions of (params, inputs, cache).

Owns: the math of one forward pass, for a padded prompt (prefill) and for one
token per slot (decode). Covers Llama (default / linear / llama3 RoPE),
Mistral (sliding window) and Qwen2 (q/k/v bias): grouped-query attention,
RMSNorm, SwiGLU, tied or untied embeddings.

Layout: layer weights (out, in), as the checkpoint has them, one set of arrays
per layer (the layer loop is unrolled, so no weight is ever sliced or copied);
`project` picks the product's form by row count (and backend); the head is
(hidden, vocab), with a (vocab, hidden) copy where decode steps use one
(`matmul_layout`, `step_logits`).

Decode cache: per layer a tuple of equal chunks along positions, keys as
(slots, kv_heads, chunk / block, head_dim, block) and values as (slots,
kv_heads, chunk, head_dim): per kv head contiguous, the sequence axis next
to head_dim, so both attention products are plain batched matmuls (q @ K^T
reads K^T rows directly). Keys come in blocks of KEY_BLOCK positions: the
CPU backend's q @ K^T ran at ~20 GB/s over 128-position blocks and ~28 GB/s
over 32-position ones (values read best 128 at a time, as they are). The
step writes its new K/V in place and reads only the chunks up to the
furthest busy slot's position, each chunk under its own cond on the device
(an online softmax carries the sums from chunk to chunk): any slice of one
big cache buffer (static, dynamic, or per block in a loop) was materialized
by XLA's CPU backend at a few GB/s and cost more than the positions it
skipped. A decode batch bucket steps the first rows of the cache's slots.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.config import ModelConfig

Params = dict[str, Any]
F32 = jnp.float32
KEY_BLOCK = 32  # positions per key block in the decode cache (at most one chunk)


def key_block(chunk: int) -> int:
    """Positions per key block for cache chunks of `chunk` positions (both powers of two)."""
    return min(KEY_BLOCK, chunk)


def key_blocks(keys: jax.Array, block: int) -> jax.Array:
    """(..., head_dim, n) keys -> (..., n / block, head_dim, block); n < block: one block."""
    *lead, dim, n = keys.shape
    width = min(block, n)
    split = keys.reshape(*lead, dim, n // width, width)
    return jnp.moveaxis(split, -2, -3)


def matmul_layout(params: Params, vocab_major: bool = False) -> Params:
    """Host params with an (hidden, vocab) `lm_head`; layer matrices stay (out, in).

    A tied checkpoint gets its own transposed head: the embedding stays
    (vocab, hidden) for the token lookup, at the cost of a second vocab x hidden copy.
    vocab_major (ModelConfig.vocab_major_head) also keeps an untied checkpoint's head
    as it comes, (vocab, hidden), as `vocab_head` (a tied one's is the embedding).
    """
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    out = params | {"lm_head": np.ascontiguousarray(head.T)}
    if vocab_major and "lm_head" in params:
        out["vocab_head"] = np.ascontiguousarray(head)
    return out


def linear(x: jax.Array, w: jax.Array, preferred: Any = None) -> jax.Array:
    """x (..., in) times w (in, out) -> (..., out), in `preferred` dtype (default x's).

    The dot always accumulates to float32: asked for a bfloat16 result, XLA's CPU
    backend converted the whole weight to float32 on every call (a copy of 2x its
    bytes) and ran bfloat16 decode matmuls 4-7x slower than this.
    """
    if w.dtype.itemsize < 4 and math.prod(x.shape[:-1]) == 1:
        return _linear_one_row(x, w).astype(preferred or x.dtype)
    out = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=F32)
    return out.astype(preferred or x.dtype)


# Rows below which `project` may put the weight on the left (engine.engine.SAME_KERNEL_ROWS
# keeps batched prefill on one side of it).
WEIGHTS_LEFT_ROWS = 64


def project(x: jax.Array, w: jax.Array, weights_left: bool) -> jax.Array:
    """x (..., in) times w (out, in)^T -> (..., out) in x's dtype, summed in float32.

    weights_left (ModelConfig.weights_left, the CPU backend's choice): 2 to
    WEIGHTS_LEFT_ROWS - 1 rows as w x rows^T, then transposed back. XLA's CPU
    backend ran that at 8-32 rows of layer shapes from 256 x 768 to 2048 x 768 in
    0.27-0.75x the time of rows x (in, out) in float32, 0.45-0.85x in bfloat16, and
    mostly faster than rows x w^T (paired calls on the 2-core development machine;
    bench/README.md).
    The barrier keeps XLA from folding the transpose back into the product (it rewrote
    transpose(dot) as the other form). Otherwise rows x w^T: as fast as rows x (in, out)
    at 1,024 rows, faster at one; a 16-bit row is run as two (no fast bfloat16
    matrix-vector product: one row took ~10x as long as two).
    """
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1])
    dims = (((1,), (1,)), ((), ()))
    if weights_left and 2 <= rows < WEIGHTS_LEFT_ROWS:
        out = lax.optimization_barrier(lax.dot_general(w, flat, dims, preferred_element_type=F32))
        out = out.T
    else:
        if w.dtype.itemsize < 4 and rows == 1:
            flat = jnp.concatenate([flat, jnp.zeros_like(flat)])
        out = lax.dot_general(flat, w, dims, preferred_element_type=F32)[:rows]
    return out.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _linear_one_row(x: jax.Array, w: jax.Array) -> jax.Array:
    """A one-row 16-bit product, run as two rows (the second zeros).

    XLA's CPU backend has no fast bfloat16 matrix-vector product: one row took
    ~10x as long as two (a 1-slot bfloat16 decode step of the 100M model, and
    every prefill's logits).
    """
    row = x.reshape(1, x.shape[-1])
    two = jnp.concatenate([row, jnp.zeros_like(row)])
    out = lax.dot_general(two, w, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    return out[:1].reshape(*x.shape[:-1], w.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(F32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype: Any) -> tuple[jax.Array, ...]:
    """cos, sin of shape positions.shape + (head_dim,), in the rotate-half convention."""
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (..., heads, head_dim); cos/sin (..., head_dim) broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def attention_inputs(
    lp: Params, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = project(h, lp["wqkv"], cfg.weights_left)
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"]
    lead = x.shape[:-1]
    # per tensor-parallel shard its q, k, v columns (one shard: the checkpoint's order)
    qkv = qkv.reshape(*lead, cfg.shards, -1)
    q_end = cfg.q_size // cfg.shards
    k_end = q_end + cfg.kv_size // cfg.shards
    q = qkv[..., :q_end].reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = qkv[..., q_end:k_end].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., k_end:].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _write_chunk(
    kc: jax.Array,
    vc: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    index: int,
) -> tuple[jax.Array, jax.Array]:
    """Chunk `index` with each of the first k.shape[0] slots' new key/value column written at
    its position, in place; a slot whose position lies in another chunk writes nothing here.

    Under a cond that skips the chunk unless it holds some slot's position. A
    scatter that drops out-of-range columns; a 16-bit cache takes a select
    over the chunk instead (XLA's CPU backend scatters into bfloat16 by
    converting the whole target to float32 and back), and a select rewrites
    its whole chunk, so selecting into every chunk cost the 100M model's
    16-slot bfloat16 step ~10 ms of its ~45.
    """
    size = vc.shape[2]
    block = kc.shape[-1]
    k, v = k.astype(kc.dtype), v.astype(vc.dtype)
    column = jnp.where(positions // size == index, positions % size, size)

    def write(kc: jax.Array, vc: jax.Array) -> tuple[jax.Array, jax.Array]:
        if kc.dtype.itemsize < 4:
            return _select_rows(kc, vc, k=k, v=v, column=column)
        slots = jnp.arange(k.shape[0])
        # out of this chunk: column // block is past the last block, and dropped
        kc = kc.at[slots, :, column // block, :, column % block].set(k, mode="drop")
        return kc, vc.at[slots, :, column, :].set(v, mode="drop")

    return lax.cond(jnp.any(column < size), write, lambda kc, vc: (kc, vc), kc, vc)


def _select_rows(
    kc: jax.Array, vc: jax.Array, *, k: jax.Array, v: jax.Array, column: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """_select_column on the first k.shape[0] slots of the chunk; the others stay as they are."""
    rows = k.shape[0]
    if rows == kc.shape[0]:
        return _select_column(kc, vc, k=k, v=v, column=column)
    top_k, top_v = _select_column(kc[:rows], vc[:rows], k=k, v=v, column=column)
    return (
        lax.dynamic_update_slice_in_dim(kc, top_k, 0, 0),
        lax.dynamic_update_slice_in_dim(vc, top_v, 0, 0),
    )


def _select_column(
    kc: jax.Array, vc: jax.Array, *, k: jax.Array, v: jax.Array, column: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """kc/vc with each slot's column (out of range: none) replaced by its k/v."""
    slots, _, size, _ = vc.shape
    hit = jnp.arange(size) == column[:, None]  # (slots, chunk)
    key_hit = hit.reshape(slots, 1, kc.shape[2], 1, kc.shape[4])
    return (
        jnp.where(key_hit, k[:, :, None, :, None], kc),
        jnp.where(hit[:, None, :, None], v[:, :, None, :], vc),
    )


Softmax = tuple[jax.Array, jax.Array, jax.Array]  # running max, sum, weighted values


def _attend_chunk(
    run: Softmax,
    qg: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    positions: jax.Array,
    index: int,
    cfg: ModelConfig,
) -> Softmax:
    """The running softmax of each slot's query, updated with chunk `index` of the cache.

    Keys a slot cannot see score -inf: a chunk it sees none of leaves its
    (max, sum, values) exactly as they were (rescaled by exp(0) = 1, plus
    0s), so a slot's result is the same bits whatever chunks other slots
    make the step read. Scores stay in the keys' block layout (slots, kv,
    blocks, groups, block) through the softmax; only the probabilities are
    reordered for the product with the values (reordering the scores slowed
    the softmax's fused loops ~3x).
    """
    top, total, out = run
    slots, kv, groups, dim = qg.shape
    if kc.shape[0] > slots:  # a batch bucket: the first `slots` slots of the cache
        kc, vc = kc[:slots], vc[:slots]
    size, blocks, block = vc.shape[2], kc.shape[2], kc.shape[4]
    qb = jnp.broadcast_to(qg[:, :, None], (slots, kv, blocks, groups, dim))
    s = lax.dot_general(
        qb, kc, (((4,), (3,)), ((0, 1, 2), (0, 1, 2))), preferred_element_type=F32
    )  # (slots, kv, blocks, groups, block)
    k_pos = (index * size + jnp.arange(size)).reshape(blocks, 1, block)
    seen = _visible(positions[:, None, None, None, None], k_pos[None, None], cfg)
    s = jnp.where(seen, s * jnp.asarray(cfg.head_dim**-0.5, qg.dtype), -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(s, axis=(2, 4)))
    shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # a slot that has seen nothing yet
    keep = jnp.exp(top - shift)
    p = jnp.exp(s - shift[:, :, None, :, None])
    total = total * keep + jnp.sum(p, axis=(2, 4))
    p = jnp.moveaxis(p, 2, 3).reshape(slots, kv, groups, size).astype(qg.dtype)
    values = jnp.einsum("skgt,sktd->skgd", p, vc, preferred_element_type=F32)
    return new_top, total, out * keep[..., None] + values


def _attend_live(
    qg: jax.Array,
    k_chunks: tuple[jax.Array, ...],
    v_chunks: tuple[jax.Array, ...],
    positions: jax.Array,
    cfg: ModelConfig,
) -> jax.Array:
    """Attention of qg over the chunks up to the furthest slot's position.

    Chunk by chunk, in chunk order, each under a cond that skips it unless
    some slot's position reaches it, so a step reads only the chunks up to
    the furthest slot's, chosen on the device, whatever max_model_len is.
    Whole chunk arrays only: XLA's CPU backend materializes any slice of the
    cache at a few GB/s, more than the positions it skips cost.
    """
    size = v_chunks[0].shape[2]
    live = jnp.max(positions) // size
    shape = qg.shape[:3]
    run = (jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32), jnp.zeros(qg.shape, F32))
    for index, (kc, vc) in enumerate(zip(k_chunks, v_chunks, strict=True)):
        step = functools.partial(_attend_chunk, index=index, cfg=cfg)
        run = lax.cond(index <= live, step, lambda run, *_: run, run, qg, kc, vc, positions)
    _, total, out = run
    return (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(qg.dtype)


def layer_output(lp: Params, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Output projection, residual, and the SwiGLU MLP block."""
    out = project(attn, lp["wo"], cfg.weights_left)
    if "bo" in lp:
        out = out + lp["bo"]
    x = x + out
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    lead = x.shape[:-1]
    gate_up = project(h, lp["w_gate_up"], cfg.weights_left)
    gate_up = gate_up.reshape(*lead, cfg.shards, -1)  # per shard gate, up
    half = cfg.intermediate_size // cfg.shards
    gated = jax.nn.silu(gate_up[..., :half]) * gate_up[..., half:]
    return x + project(gated.reshape(*lead, cfg.intermediate_size), lp["w_down"], cfg.weights_left)


def _visible(q_pos: jax.Array, k_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal (and sliding-window) visibility of key positions from query positions."""
    mask = k_pos <= q_pos
    if cfg.sliding_window is not None:
        mask = mask & (k_pos > q_pos - cfg.sliding_window)
    return mask


def _softmax_attend(scores: jax.Array, mask: jax.Array, dtype: Any) -> jax.Array:
    scores = jnp.where(mask, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def logits_of(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and vocabulary projection, float32 logits (..., vocab)."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return linear(x, params["lm_head"], preferred=F32).astype(F32)


def step_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rows (R, hidden) -> float32 logits, (vocab, R) when cfg.vocab_major_head, else
    (R, vocab): the layout engine.sampling.sample is told.

    Vocab-major, 2+ rows are one product with the head as the left operand, (vocab,
    hidden) x rows^T. XLA's CPU backend ran rows (R, hidden) @ (hidden, vocab) in
    float32 at 2-32 rows 1.3-3.6x as long (paired calls on the 2-core development
    machine: 0.60-0.77x at 4-32 rows of hidden 256 x 128,256, 0.28-0.36x of 768 x
    50,257; bench/README.md), but one row 1.1-1.5x faster, so one row keeps the
    (hidden, vocab) head: its (1, vocab) logits are the (vocab, 1) layout byte for byte.
    """
    rows = x.shape[0]
    if not cfg.vocab_major_head:
        return logits_of(params, x, cfg)
    if rows == 1:
        return logits_of(params, x, cfg).reshape(cfg.vocab_size, 1)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["vocab_head"] if "vocab_head" in params else params["embed"]  # tied: embed
    out = lax.dot_general(head, x, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    return out.astype(F32)


def last_logits(params: Params, rows: jax.Array, cfg: ModelConfig, product_rows: int) -> jax.Array:
    """Logits of prompts' last positions: (R, hidden) -> (R, vocab), float32.

    A prompt's first token must not depend on the prompts prefilled with it, so every
    row's logits come from a product of one fixed kind. `product_rows` 1: each row on
    its own (a one-row product: XLA's CPU backend runs a matrix-vector kernel, whose
    float32 sums differ in the last bits from its matrix kernel's). n >= 2: products of
    2 to n rows (a lone row padded with a zero row; R > n as R / n products of n rows),
    for a backend whose matrix kernel gives a row the same bits at every such row
    count: at 8 rows of a 128k vocabulary one ~25 ms product instead of eight ~7 ms
    ones. The engine measures the largest such n on its devices (Engine._product_rows):
    XLA:CPU rounded row 0 of a 16-row product of the 128k head otherwise than at 2-15.
    """
    count = rows.shape[0]
    if product_rows <= 1:
        if count == 1:
            return logits_of(params, rows, cfg)
        return lax.map(lambda row: logits_of(params, row[None], cfg)[0], rows)
    size = max(2, min(count, product_rows))
    padded = -(-count // size) * size
    if padded > count:
        rows = jnp.concatenate([rows, jnp.zeros((padded - count, rows.shape[1]), rows.dtype)])
    parts = []
    for start in range(0, padded, size):  # separate products, each of `size` rows
        out = step_logits(params, rows[start : start + size], cfg)
        parts.append(out.T if cfg.vocab_major_head else out)
    return jnp.concatenate(parts)[:count] if len(parts) > 1 else parts[0][:count]


def prefill_forward(
    params: Params,
    tokens: jax.Array,
    length: jax.Array,
    inv_freq: jax.Array,
    cfg: ModelConfig,
    all_logits: bool = False,
    product_rows: int = 1,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One prompt padded to T tokens -> (logits, k, v).

    logits is (T, vocab) when all_logits else (1, vocab) at position length-1;
    k is a tuple of one (kv_heads, head_dim, T) array per layer, v one of
    (kv_heads, T, head_dim) arrays, the decode cache's layouts. Padding
    positions only see the real tokens before them, so real positions are exact.
    """
    x, keys, values = prefill_hidden(params, tokens, inv_freq, cfg)
    if all_logits:
        return logits_of(params, x, cfg), keys, values
    row = lax.dynamic_slice_in_dim(x, length - 1, 1, axis=0)
    return last_logits(params, row, cfg, product_rows), keys, values


def prefill_hidden(
    params: Params, tokens: jax.Array, inv_freq: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The final hidden states (T, hidden), before the last norm, and each layer's K and V."""
    t = tokens.shape[0]
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = rope_tables(positions, inv_freq, dtype)
    mask = _visible(positions[:, None], positions[None, :], cfg)
    groups = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim**-0.5

    keys, values = [], []
    for lp in params["layers"]:
        q, k, v = attention_inputs(lp, x, cfg, cos, sin)
        qg = q.reshape(t, cfg.num_kv_heads, groups, cfg.head_dim)
        scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=F32)
        probs = _softmax_attend(scores * jnp.asarray(scale, dtype), mask, dtype)
        attn = jnp.einsum("kgts,skd->tkgd", probs, v, preferred_element_type=F32)
        attn = attn.astype(dtype).reshape(t, cfg.q_size)
        x = layer_output(lp, x, attn, cfg)
        keys.append(k.transpose(1, 2, 0))
        values.append(v.transpose(1, 0, 2))
    return x, tuple(keys), tuple(values)


def prefill_chunk_hidden(
    params: Params,
    tokens: jax.Array,
    offset: jax.Array,
    k_buf: tuple[jax.Array, ...],
    v_buf: tuple[jax.Array, ...],
    inv_freq: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Prompt positions offset..offset+C-1 (C = len(tokens)) on top of the ones before them.

    k_buf / v_buf are per layer the prompt's KV so far in prefill's layouts,
    (kv_heads, head_dim, P) and (kv_heads, P, head_dim), positions < offset
    filled; the chunk's KV is written at offset (offset + C <= P) and its
    queries attend to every position up to their own. Returns the chunk's final
    hidden states (C, hidden) and the buffers. One shape per (C, P), whatever
    the prompt's length, so a long prompt costs no bucket of its own.
    """
    c = tokens.shape[0]
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    positions = offset + jnp.arange(c, dtype=jnp.int32)
    cos, sin = rope_tables(positions, inv_freq, dtype)
    capacity = v_buf[0].shape[1]
    mask = _visible(positions[:, None], jnp.arange(capacity)[None, :], cfg)
    groups = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim**-0.5

    keys, values = [], []
    for lp, kb, vb in zip(params["layers"], k_buf, v_buf, strict=True):
        q, k, v = attention_inputs(lp, x, cfg, cos, sin)
        kb = lax.dynamic_update_slice(kb, k.transpose(1, 2, 0).astype(kb.dtype), (0, 0, offset))
        vb = lax.dynamic_update_slice(vb, v.transpose(1, 0, 2).astype(vb.dtype), (0, offset, 0))
        qg = q.reshape(c, cfg.num_kv_heads, groups, cfg.head_dim)
        scores = jnp.einsum("tkgd,kds->kgts", qg, kb, preferred_element_type=F32)
        probs = _softmax_attend(scores * jnp.asarray(scale, dtype), mask, dtype)
        attn = jnp.einsum("kgts,ksd->tkgd", probs, vb, preferred_element_type=F32)
        x = layer_output(lp, x, attn.astype(dtype).reshape(c, cfg.q_size), cfg)
        keys.append(kb)
        values.append(vb)
    return x, tuple(keys), tuple(values)


def decode_forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    k_cache: tuple[tuple[jax.Array, ...], ...],
    v_cache: tuple[tuple[jax.Array, ...], ...],
    inv_freq: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, tuple[tuple[jax.Array, ...], ...], tuple[tuple[jax.Array, ...], ...]]:
    """One token for each of the first `rows` slots at its position -> (logits, k_cache,
    v_cache), rows = tokens.shape[0] (at most the cache's slots); logits in
    step_logits' layout.

    The cache is per layer a tuple of chunks, keys (slots, kv_heads, blocks,
    head_dim, block) and values (slots, kv_heads, chunk, head_dim), chunk i
    holding positions i*chunk... Each row's new K/V is written at its
    position; attention reads positions <= position, in the chunks up to the
    furthest row's, of the first `rows` slots only. Callers keep positions <
    the cache's capacity.
    """
    slots = tokens.shape[0]
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    cos, sin = rope_tables(positions, inv_freq, dtype)
    groups = cfg.num_heads // cfg.num_kv_heads

    new_k, new_v = [], []
    for lp, k_layer, v_layer in zip(params["layers"], k_cache, v_cache, strict=True):
        q, k, v = attention_inputs(lp, x, cfg, cos, sin)
        written = [
            _write_chunk(kc, vc, k, v, positions, i)
            for i, (kc, vc) in enumerate(zip(k_layer, v_layer, strict=True))
        ]
        k_layer, v_layer = tuple(kc for kc, _ in written), tuple(vc for _, vc in written)
        qg = q.reshape(slots, cfg.num_kv_heads, groups, cfg.head_dim)
        attn = _attend_live(qg, k_layer, v_layer, positions, cfg)
        x = layer_output(lp, x, attn.reshape(slots, cfg.q_size), cfg)
        new_k.append(k_layer)
        new_v.append(v_layer)
    return step_logits(params, x, cfg), tuple(new_k), tuple(new_v)
