"""Model shapes the accelerator benchmarks build with random or abstract params.

Owns: the Llama-3.2-1B and Llama-3.1-8B configurations (their config.json values) and
the param shapes engine.checkpoint.load_params gives such a checkpoint. No JAX backend
is touched on import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from engine.config import ModelConfig, tensor_parallel

CONFIGS = {
    # Llama-3.2-1B and Llama-3.1-8B shapes (config.json of each).
    "1b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "8b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}


def model_config(name: str, layers: int | None, tp: int) -> ModelConfig:
    cfg = CONFIGS[name]
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return tensor_parallel(cfg, tp) if tp > 1 else cfg


def checkpoint_shapes(cfg: ModelConfig, dtype: Any, slot_layout: bool) -> dict[str, Any]:
    """Abstract params as engine.checkpoint.load_params lays them out over cfg.shards
    devices (slot_layout: after engine.model.matmul_layout, the slot engine's)."""
    h = cfg.hidden_size

    def a(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = {
        "attn_norm": a(h),
        "wqkv": a(cfg.q_size + 2 * cfg.kv_size, h),
        "wo": a(h, cfg.q_size),
        "mlp_norm": a(h),
        "w_gate_up": a(2 * cfg.intermediate_size, h),
        "w_down": a(h, cfg.intermediate_size),
    }
    params: dict[str, Any] = {
        "embed": a(cfg.vocab_size, h),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
        "final_norm": a(h),
    }
    if slot_layout:
        params["lm_head"] = a(h, cfg.vocab_size)  # the transposed copy, tied or not
    elif not cfg.tie_word_embeddings:
        params["lm_head"] = a(cfg.vocab_size, h)
    return params
