"""engine.paged_model: the decoder over paged KV in ragged steps gives each position the
logits of transformers' forward pass over the whole prompt, whatever the steps' mix of
prompt chunks and decode rows."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from engine.attention import KVLayout, ReferenceAttention
from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.paged_model import Chunk, forward, head_logits, make_batch

PAGE = 8


def whole_prompt_logits(folder, cfg, params, prompt):  # type: ignore[no-untyped-def]
    """transformers' logits over the whole prompt at once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([list(prompt)])).logits[0].numpy()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama_tied"])
def test_ragged_steps_match_whole_prompt_prefill(tiny_checkpoint_of, arch: str) -> None:
    folder = tiny_checkpoint_of(arch)
    cfg = load_model_config(folder)
    params = load_params(folder, cfg, "float32")
    rng = np.random.default_rng(3)
    a = rng.integers(0, cfg.vocab_size, 40).tolist()  # a prompt in three chunks
    b = rng.integers(0, cfg.vocab_size, 12).tolist()  # a prompt, then two decode rows
    layout = KVLayout(
        num_pages=16, page_size=PAGE, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
    )
    step = jax.jit(
        functools.partial(forward, cfg=cfg, attention=ReferenceAttention(layout)),
        donate_argnums=(1,),
    )
    pages = tuple(layout.empty() for _ in range(cfg.num_layers))
    a_pages, b_pages = [9, 2, 14, 5, 7], [0, 11]  # scattered, not in order
    steps = [
        [Chunk(a[:16], 0, a_pages[:2]), Chunk(b[:10], 0, b_pages)],
        [Chunk(b[10:11], 10, b_pages), Chunk(a[16:32], 16, a_pages[:4])],
        [Chunk(a[32:40], 32, a_pages), Chunk(b[11:12], 11, b_pages)],
    ]
    got: dict[tuple[str, int], np.ndarray] = {}
    inv_freq = cfg.rope_inv_freq()
    for chunks in steps:
        batch = make_batch(
            chunks, tokens=32, seqs=4, pages_per_seq=6, page_size=PAGE, num_pages=layout.num_pages
        )
        x, pages = step(params, pages, batch, inv_freq)
        logits = head_logits(params, x[np.asarray(batch.last)], cfg)
        for row, chunk in enumerate(chunks):
            name = "a" if chunk.pages is a_pages or chunk.pages[0] == 9 else "b"
            got[(name, chunk.start + len(chunk.tokens) - 1)] = np.asarray(logits[row])

    want_a = whole_prompt_logits(folder, cfg, params, a)
    want_b = whole_prompt_logits(folder, cfg, params, b)
    for (name, position), row in got.items():
        want = (want_a if name == "a" else want_b)[position]
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-4, err_msg=f"{name}@{position}")
    assert len(got) == 6


def test_padding_writes_nothing_and_pages_of_others_stay(tiny_checkpoint_of) -> None:
    folder = tiny_checkpoint_of("llama")
    cfg = load_model_config(folder)
    params = load_params(folder, cfg, "float32")
    layout = KVLayout(num_pages=6, page_size=PAGE, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    marker = np.full(layout.shape, 7.0, np.float32)
    pages = tuple(jax.numpy.asarray(marker) for _ in range(cfg.num_layers))
    batch = make_batch(
        [Chunk([1, 2, 3], 0, [4])],
        tokens=16,
        seqs=2,
        pages_per_seq=2,
        page_size=PAGE,
        num_pages=layout.num_pages,
    )
    _, out = forward(params, pages, batch, cfg.rope_inv_freq(), cfg, ReferenceAttention(layout))
    for layer in out:
        layer = np.asarray(layer)
        changed = np.argwhere((layer != 7.0).any(axis=(2, 3)))
        assert sorted(map(tuple, changed)) == [(4, 0), (4, 1), (4, 2)]


def test_make_batch_rejects_too_few_pages() -> None:
    with pytest.raises(ValueError, match="pages"):
        make_batch(
            [Chunk(list(range(9)), 0, [0])],
            tokens=16,
            seqs=2,
            pages_per_seq=2,
            page_size=PAGE,
            num_pages=4,
        )
