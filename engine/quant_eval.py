"""The error of a quantized model against the unquantized one, teacher-forced over a text.

Owns: `teacher_forced_logits` (every position's next-token logits of a fixed token
sequence, run through the engine's own step (engine.paged_model.forward) in prompt
chunks over a paged cache of a given dtype, with the reference attention), and
`compare` (`QuantError`: relative logits error, KL divergence, top-1 agreement).
Receives params (quantized by engine.quant or not) and tokens; emits float32 logits and
the three figures. Used by tests/engine/test_quant.py (the bounds) and
bench/quant_report.py (the report).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.attention import KVLayout, ReferenceAttention
from engine.attention.kv_dtype import storage_dtype
from engine.config import ModelConfig
from engine.model import Params
from engine.paged_model import Chunk, forward, head_logits, make_batch, stack_layers


@dataclass(frozen=True)
class QuantError:
    rel_logits_error: float  # ||l_q - l|| / ||l|| over every position's logits
    kl: float  # mean over positions of KL(softmax(l) || softmax(l_q)), in nats
    top1: float  # fraction of positions whose argmax agrees


def teacher_forced_logits(
    params: Params,
    cfg: ModelConfig,
    tokens: Sequence[int],
    *,
    kv_cache_dtype: str = "auto",
    chunk: int = 128,
    page_size: int = 16,
) -> np.ndarray:
    """(len(tokens), vocab) float32: position p's logits for token p + 1, the text run in
    chunks of `chunk` tokens, each attending to the pages of those before it."""
    model_dtype = str(params["final_norm"].dtype)
    num_pages = -(-len(tokens) // page_size)
    layout = KVLayout(
        num_pages,
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        storage_dtype(kv_cache_dtype, model_dtype),
    )
    attention = ReferenceAttention(layout.stacked(cfg.num_layers))
    step = jax.jit(functools.partial(_chunk_logits, cfg=cfg, attention=attention))
    pages = attention.layout.empty()
    params = stack_layers(params)
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    table = list(range(num_pages))
    out = []
    for start in range(0, len(tokens), chunk):
        part = list(tokens[start : start + chunk])
        batch = make_batch(
            [Chunk(part, start, table)],
            tokens=chunk,
            seqs=1,
            pages_per_seq=num_pages,
            page_size=page_size,
            num_pages=num_pages,
        )
        logits, pages = step(params, pages, batch, inv_freq)
        out.append(np.asarray(logits[: len(part)]))
    return np.concatenate(out)


def _chunk_logits(
    params: Params,
    pages: jax.Array,
    batch: object,
    inv_freq: jax.Array,
    *,
    cfg: ModelConfig,
    attention: ReferenceAttention,
) -> tuple[jax.Array, jax.Array]:
    x, pages = forward(params, pages, batch, inv_freq, cfg, attention)  # type: ignore[arg-type]
    return head_logits(params, x, cfg), pages


def compare(reference: np.ndarray, quantized: np.ndarray) -> QuantError:
    """The quantized model's logits against the reference's, position by position."""
    ref = reference.astype(np.float64)
    got = quantized.astype(np.float64)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    log_p = ref - _logsumexp(ref)
    log_q = got - _logsumexp(got)
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
    top1 = float(np.mean(np.argmax(ref, axis=-1) == np.argmax(got, axis=-1)))
    return QuantError(rel, kl, top1)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = np.max(x, axis=-1, keepdims=True)
    return top + np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))
