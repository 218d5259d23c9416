"""Logits parity with transformers' own PyTorch implementation of the same random checkpoints.

Prefill: the engine's last-position logits and its prompt logprobs (every position)
against the Hugging Face forward pass. Decode: 8 steps fed one token at a time
through insert/generate, each step's logits against a fresh Hugging Face forward
pass over the whole sequence so far.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

ARCHS = ("llama", "llama3_rope", "mistral", "qwen2", "llama_tied")
F32_TOL = 1e-4
BF16_TOL = 0.1  # measured: max |bf16 engine - f32 transformers| ~0.03 on logits up to ~3
PROMPTS = (
    [0, 42, 364, 78, 81],
    [0, 5, 9, 200, 17, 301, 44, 12, 9, 99, 100, 101, 7],
    list(range(3, 30)),
)
DECODE_PROMPT = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223, 163, 124, 257, 502, 315, 249, 225, 40]
GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=5)


def hf_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager"
    )
    return model.eval()


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def decode_logits(engine: Engine, prompt: list[int], steps: int) -> tuple[list[int], list]:
    """Greedy tokens and per-step logits of `prompt` in slot 1 via insert/generate."""
    prefix = engine.prefill(prompt, GREEDY)
    state = engine.insert(prefix, engine.init_state(), 1)
    tokens, logits = [int(prefix.token)], [np.asarray(prefix.last_logits)]
    for _ in range(steps):
        state, out, step_logits = engine.generate_with_logits(state)
        assert bool(out.active[1]) and not bool(out.active[0])
        tokens.append(int(out.tokens[1]))
        logits.append(np.asarray(step_logits[1]))
        np.testing.assert_allclose(
            float(out.logprobs[1]), log_softmax(logits[-1])[tokens[-1]], atol=1e-5
        )
    return tokens, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch, tiny_checkpoint_of):
    folder = tiny_checkpoint_of(arch)
    engine = Engine(EngineConfig(folder, max_slots=2, max_model_len=64))
    model = hf_model(folder)
    for prompt in PROMPTS:
        ref = hf_logits(model, prompt)
        prefix = engine.prefill(prompt, GREEDY, prompt_logprobs=5)
        np.testing.assert_allclose(np.asarray(prefix.last_logits), ref[-1], atol=F32_TOL, rtol=0)
        assert int(prefix.token) == int(ref[-1].argmax())
        ref_lp = log_softmax(ref)
        got = [e.logprob for e in prefix.prompt_logprobs[1:]]
        want = [ref_lp[i - 1, prompt[i]] for i in range(1, len(prompt))]
        np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=0)
        top = prefix.prompt_logprobs[-1].top
        assert [t for t, _ in top] == list(np.argsort(-ref_lp[-2])[:5])

    tokens, logits = decode_logits(engine, DECODE_PROMPT, steps=8)
    sequence = DECODE_PROMPT + tokens
    ref = hf_logits(model, sequence[:-1])[len(DECODE_PROMPT) - 1 :]
    errors = [float(np.abs(got - want).max()) for got, want in zip(logits, ref, strict=True)]
    assert max(errors) < F32_TOL, errors
    assert tokens == [int(r.argmax()) for r in ref]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_across_key_blocks_and_chunks_matches_transformers(dtype, tiny_checkpoint_of):
    """max_model_len 512: cache chunks of 64 positions, keys in two blocks of 32 each; a
    60-token prompt (bucket 64: both blocks) decodes across the first chunk boundary."""
    folder = tiny_checkpoint_of("llama")
    engine = Engine(EngineConfig(folder, dtype=dtype, max_slots=2, max_model_len=512))
    k_chunk, v_chunk = engine.init_state().k_cache[0][0], engine.init_state().v_cache[0][0]
    assert k_chunk.shape[2] == 2 and v_chunk.shape[2] == 64
    prompt = [0] + [(37 * i) % 500 + 3 for i in range(59)]
    tokens, logits = decode_logits(engine, prompt, steps=8)
    ref = hf_logits(hf_model(folder), (prompt + tokens)[:-1])[len(prompt) - 1 :]
    error = max(float(np.abs(got - want).max()) for got, want in zip(logits, ref, strict=True))
    assert error < (F32_TOL if dtype == "float32" else BF16_TOL), error


def test_bfloat16_logits_stay_close_to_float32_reference(tiny_checkpoint_of):
    """bfloat16 params and cache: max abs logit error against the float32 reference."""
    folder = tiny_checkpoint_of("llama")
    engine = Engine(EngineConfig(folder, dtype="bfloat16", max_slots=2, max_model_len=64))
    _, logits = decode_logits(engine, DECODE_PROMPT, steps=8)
    model = hf_model(folder)
    tokens = DECODE_PROMPT + [int(np.argmax(x)) for x in logits]
    ref = hf_logits(model, tokens[:-1])[len(DECODE_PROMPT) - 1 :]
    error = max(float(np.abs(got - want).max()) for got, want in zip(logits, ref, strict=True))
    assert error < BF16_TOL, error
