"""Any max_model_len up to the model's max_position_embeddings serves, powers of two or not.

A bucket that is not a whole number of key blocks (300 = 4 chunks of 64 and 44
positions) once failed to reshape in insert, during warm-up. Each length here
has its own length as the prefill bucket, decodes a prompt through the bucket's
padded tail to the end of the context, and its last logits match transformers'
forward pass over the same tokens. The first case warms up whole (every shape
of its engine); the others compile only what they run (the same prefill, insert
and step shapes warm-up would), to keep the suite's time.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine, EngineConfig
from engine.types import SamplingParams

MAX_POSITIONS = 4097
GREEDY = SamplingParams(temperature=0.0, seed=0)
TAIL = 20  # decode steps from the prompt's end to the context's


@pytest.mark.parametrize(
    "max_len,chunk", [(300, None), (300, 64), (1000, None), (2000, None), (MAX_POSITIONS, None)]
)
def test_a_context_of_any_length_decodes_to_its_end(tiny_checkpoint_of, max_len, chunk):
    """Whole prompts in one bucket of the context's length, and (chunk) in 64-token pieces."""
    folder = tiny_checkpoint_of("llama", max_position_embeddings=MAX_POSITIONS)
    buckets = (max_len,) if chunk is None else None
    engine = Engine(
        EngineConfig(
            folder, max_slots=2, max_model_len=max_len, prefill_buckets=buckets, prefill_chunk=chunk
        )
    )
    if (max_len, chunk) == (300, None):
        engine.warmup()
    prompt = [3 + (7 * i) % 500 for i in range(max_len - TAIL)]
    prefix = engine.prefill(prompt, GREEDY)
    state = engine.insert(prefix, engine.init_state(), 1)
    tokens, logits = [int(prefix.token)], None
    for _ in range(TAIL):
        state, out, logits = engine.generate_with_logits(state)
        assert bool(out.active[1])
        tokens.append(int(out.tokens[1]))
    assert int(state.lengths[1]) == max_len
    state, out = engine.generate(state)
    assert not bool(out.active[1])  # the context is full: the slot went idle

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt + tokens[:-1]])).logits[0, -1].numpy()
    np.testing.assert_allclose(np.asarray(logits[1]), want, atol=1e-4, rtol=0)
    assert tokens[-1] == int(np.argmax(want))


def test_a_context_past_the_models_positions_is_refused_at_start(tiny_checkpoint_of):
    folder = tiny_checkpoint_of("llama", max_position_embeddings=MAX_POSITIONS)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(EngineConfig(folder, max_model_len=MAX_POSITIONS + 1))
