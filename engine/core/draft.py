"""The draft model of speculative decoding: a second, smaller model that proposes tokens.

Runs on: the engine core's loop thread. Owns: the draft's runner (its params and its own
KV pages, one array per draft layer, indexed by the target's page ids: a page of a
sequence holds both models' K/V for the same positions, so the prefix cache, preemption
and the trimming of rejected drafts need nothing of their own). Receives every step's
plan (`follow`: the draft writes its K/V wherever the target writes its own, prompt
chunks included) and `DraftRequest`s; emits each request's greedy draft tokens, k steps
of the draft for k tokens, every speculating sequence in each.

A draft's positions are the ones the target's verification writes next, so the draft's
K/V for a rejected tail is overwritten, like the target's, before anything reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jax.sharding import Mesh

from engine.attention import KVLayout, attention_backend
from engine.config import ModelConfig, load_model_config, tensor_parallel
from engine.core.runner import Chunk, RowWork, Runner, StepPlan
from engine.core.speculation import DraftRequest
from engine.model import Params
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)


class DraftProposer:
    """Greedy proposals from the draft's runner."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        inputs = [r.tokens[-1] for r in requests]
        for j in range(max(r.k for r in requests)):
            live = [i for i, r in enumerate(requests) if j < r.k]
            rows = tuple(
                RowWork(
                    chunk=Chunk((inputs[i],), requests[i].start + j, requests[i].pages),
                    row=requests[i].row,
                    sampling=GREEDY,
                    generated=0,
                    emits=False,  # the draft's own counts are never read: greedy, no penalty
                )
                for i in live
            )
            result = self.runner.step(StepPlan(rows))
            for n, i in enumerate(live):
                inputs[i] = int(result.tokens[result.sample_rows[n]])
                out[i].append(inputs[i])
        return out

    def follow(self, plan: StepPlan) -> None:
        self.runner.fill(plan)  # its K/V only: no head, no sampling


def draft_config(folder: str | Path, target: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The draft checkpoint's config, checked against the target's vocabulary."""
    cfg = load_model_config(folder)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config model {folder} has a vocabulary of {cfg.vocab_size} tokens; "
            f"the served model's has {target.vocab_size}"
        )
    return tensor_parallel(cfg, tensor_parallel_size) if tensor_parallel_size > 1 else cfg


def build_draft(
    params: Params,
    cfg: ModelConfig,
    layout: KVLayout,
    mesh: Mesh,
    *,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    chunk_size: int,
    max_prefill_seqs: int,
) -> DraftProposer:
    """The draft's runner on the target's mesh (params placed by the caller, before the
    pages are counted), its pages as many as the target's."""
    platform = mesh.devices.flat[0].platform
    attention = attention_backend(
        platform,
        layout.stacked(cfg.num_layers),
        mesh,
        chunk_size=chunk_size,
        max_prefill_seqs=max_prefill_seqs,
    )
    runner = Runner(
        params,
        cfg,
        layout,
        attention,
        mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return DraftProposer(runner)
