"""The engine core against transformers' own PyTorch implementation of the same random
checkpoints: prompt logprobs at every position, and greedy decoding step by step (each
token, its logprob and its best alternatives against a fresh forward pass over the
sequence so far), in float32 and bfloat16, across pages and prompt chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.core.core import CoreConfig, EngineCore
from engine.core.scheduler import Emitted, SequenceState
from engine.types import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "llama_tied")
F32_TOL = 1e-4
BF16_TOL = 0.1  # measured: max |bf16 core - f32 transformers| ~0.03 on logprobs of ~-6
GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=5)
PROMPT = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223, 163, 124, 257, 502, 315, 249, 225, 40]


def hf_logprobs(folder: Path, tokens: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def run(core: EngineCore, seq: SequenceState) -> list[Emitted]:
    core.add(seq)
    out: list[Emitted] = []
    while core.scheduler.busy:
        out += core.step()
    return out


def core_of(folder: Path, **options: object) -> EngineCore:
    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))  # type: ignore[arg-type]


def check(events: list[Emitted], prompt: list[int], want: np.ndarray, tol: float) -> None:
    """`want`: transformers' logprobs over prompt + generated tokens (all but the last)."""
    tokens = [e.token for e in events]
    n = len(prompt)
    assert tokens == [int(np.argmax(want[n - 1 + i])) for i in range(len(tokens))]
    entries = events[0].prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == n
    got = [e.logprob for e in entries[1:]]  # type: ignore[union-attr]
    np.testing.assert_allclose(got, [want[p - 1, prompt[p]] for p in range(1, n)], atol=tol)
    for i, event in enumerate(events):
        np.testing.assert_allclose(event.logprob, want[n - 1 + i, event.token], atol=tol)
        if tol == F32_TOL:  # bfloat16 may swap near-equal alternatives
            assert [t for t, _ in event.top[:5]] == list(np.argsort(-want[n - 1 + i])[:5])


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_and_greedy_decoding_match_transformers(arch, tiny_checkpoint_of):
    folder = tiny_checkpoint_of(arch)
    events = run(core_of(folder), SequenceState("p", tuple(PROMPT), GREEDY, 8, prompt_logprobs=5))
    tokens = PROMPT + [e.token for e in events]
    check(events, PROMPT, hf_logprobs(folder, tokens[:-1]), F32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_prompt_across_chunks_and_pages_matches_transformers(dtype, tiny_checkpoint_of):
    """300 prompt tokens: 19 chunks of 16 (pages of 8) computed on top of the pages before
    them, then 8 decode steps."""
    folder = tiny_checkpoint_of("llama")
    prompt = [0] + [(37 * i) % 500 + 3 for i in range(299)]
    core = core_of(folder, dtype=dtype, max_model_len=512)
    # on CPU bfloat16 pages are kept as their bits (KVLayout.bits): read back the same
    assert core.runner.pages.dtype == {"float32": "float32", "bfloat16": "uint16"}[dtype]
    events = run(core, SequenceState("p", tuple(prompt), GREEDY, 8, prompt_logprobs=5))
    tokens = prompt + [e.token for e in events]
    want = hf_logprobs(folder, tokens[:-1])
    if dtype == "float32":
        check(events, prompt, want, F32_TOL)
        return
    got = [e.logprob for e in events[0].prompt_logprobs[1:]]  # type: ignore[union-attr]
    error = np.abs(np.asarray(got) - [want[p - 1, prompt[p]] for p in range(1, len(prompt))])
    assert error.max() < BF16_TOL, error.max()
