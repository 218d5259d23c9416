"""Any max_model_len up to the model's max_position_embeddings serves, powers of two or
not: a prompt of all but 20 positions of the context, in chunks over many pages, then
decoding to the context's end, where the sequence ends with "length"; each generated
token is the argmax of transformers' forward pass over the same tokens, with its
logprob."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.scheduler import SequenceState
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core

MAX_POSITIONS = 4097
GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=1)
TAIL = 20  # decode steps from the prompt's end to the context's


@pytest.mark.parametrize("max_len", [300, 1000, MAX_POSITIONS])
def test_a_context_of_any_length_decodes_to_its_end(tiny_checkpoint_of, max_len) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tiny_checkpoint_of("llama", max_position_embeddings=MAX_POSITIONS)
    core = core_of(
        folder, max_num_seqs=2, max_model_len=max_len, max_num_batched_tokens=256,
        chunk_size=256, page_size=16,
    )  # fmt: skip
    prompt = [3 + (7 * i) % 500 for i in range(max_len - TAIL)]
    events = run_core(core, [SequenceState("s", tuple(prompt), GREEDY, 10 * TAIL)])["s"]
    assert len(events) == TAIL and events[-1].finish_reason == "length"
    tokens = [e.token for e in events]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    want = torch.log_softmax(logits.double(), dim=-1).numpy()
    assert tokens == [int(np.argmax(row)) for row in want]
    np.testing.assert_allclose(
        [e.logprob for e in events], [want[i, t] for i, t in enumerate(tokens)], atol=1e-4
    )


def test_a_context_past_the_models_positions_is_refused_at_start(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint_of("llama", max_position_embeddings=MAX_POSITIONS)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        core_of(folder, max_model_len=MAX_POSITIONS + 1)
