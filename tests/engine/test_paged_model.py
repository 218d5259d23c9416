"""engine.paged_model: the decoder over paged KV in ragged steps gives each position the
logits of transformers' forward pass over the whole prompt, whatever the steps' mix of
prompt chunks and decode rows; the head's layouts, and the packed product weights."""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import row_dot
from engine.attention import KVLayout, ReferenceAttention
from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.paged_model import (
    HEAD_MAX_ROWS,
    PRODUCT_WEIGHTS,
    Chunk,
    embed_tokens,
    forward,
    head_logits,
    hidden_major_head,
    make_batch,
    packed_products,
    row_invariant_products,
    stack_layers,
)
from engine.quant import quantize_params

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
    stacked = layout.stacked(cfg.num_layers)
    step = jax.jit(
        functools.partial(forward, cfg=cfg, attention=ReferenceAttention(stacked)),
        donate_argnums=(1,),
    )
    pages = stacked.empty()
    layered = stack_layers(params)
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
        x, pages = step(layered, pages, batch, inv_freq)
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
    stacked = layout.stacked(cfg.num_layers)
    pages = jax.numpy.full(stacked.shape, 7.0, np.float32)
    batch = make_batch(
        [Chunk([1, 2, 3], 0, [4])],
        tokens=16,
        seqs=2,
        pages_per_seq=2,
        page_size=PAGE,
        num_pages=layout.num_pages,
    )
    params = stack_layers(params)
    _, out = forward(params, pages, batch, cfg.rope_inv_freq(), cfg, ReferenceAttention(stacked))
    by_layer = np.asarray(out).reshape(cfg.num_layers, *layout.shape)
    for layer in by_layer:
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


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_hidden_major_head_gives_the_checkpoint_layouts_logits(tiny_checkpoint_of, arch) -> None:
    folder = tiny_checkpoint_of(arch)
    cfg = load_model_config(folder)
    params = jax.device_put(load_params(folder, cfg, "float32"))
    moved = hidden_major_head(params, cfg)
    if cfg.tie_word_embeddings:
        assert moved is params  # the embedding is the head: no transposed copy is made
        return
    assert "lm_head" not in moved
    np.testing.assert_array_equal(np.asarray(moved["lm_head_t"]), np.asarray(params["lm_head"]).T)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, cfg.hidden_size), np.float32))
    np.testing.assert_allclose(
        np.asarray(head_logits(moved, x, cfg)), np.asarray(head_logits(params, x, cfg)), rtol=1e-5
    )
    quantized = quantize_params(params, "int8")
    assert hidden_major_head(quantized, cfg) is quantized  # int8 keeps its per-row scales


def test_hidden_major_head_gives_a_row_the_same_bits_in_any_number_of_rows(
    tiny_checkpoint_of,
) -> None:
    """At a served model's head shape (hidden 256, a Llama 3 sized vocabulary): a row's
    logits are the same bits whether it is computed alone or among 3 to 128 rows (the
    runner's buckets: a batch's rows, a speculative verify's, prompt logprobs' tokens)."""
    cfg = replace(load_model_config(tiny_checkpoint_of("llama")), hidden_size=256)
    rng = np.random.default_rng(1)
    vocab = 128256
    params = {
        "final_norm": jnp.ones((256,), jnp.float32),
        "lm_head": jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.02),
    }
    params = hidden_major_head(params, cfg)
    head = jax.jit(functools.partial(head_logits, cfg=cfg))
    x = rng.standard_normal((128, 256), np.float32)
    alone = np.stack([np.asarray(head(params, x[i : i + 1]))[0] for i in (0, 2, 31, 32, 63, 127)])
    for rows in (3, 8, HEAD_MAX_ROWS, 2 * HEAD_MAX_ROWS, 128):
        got = np.asarray(head(params, x[:rows]))
        for j, i in enumerate((0, 2, 31, 32, 63, 127)):
            if i < rows:
                np.testing.assert_array_equal(got[i], alone[j], err_msg=f"row {i} of {rows}")


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_products_pack_what_the_kernel_reads(
    tiny_checkpoint_of, arch: str, dtype: str
) -> None:
    """float32 layer stacks and the head go packed wherever the kernel runs, bfloat16 ones
    where its pair products are native (each the `row_dot.pack` of its stack, the
    originals taken with `consume`); a tied embedding is read from its packed head as
    stored; the step stays row-invariant and its output and logits within rounding of
    the lane form's. Without ModelConfig.row_products nothing is packed (only the kernel
    reads them)."""
    folder = tiny_checkpoint_of(arch)
    cfg = replace(load_model_config(folder), row_products=row_dot.available())
    params = stack_layers(jax.device_put(load_params(folder, cfg, dtype)))
    assert packed_products(params, replace(cfg, row_products=False)) is params
    native = cfg.row_products and (dtype == "float32" or row_dot.bf16_native())
    packed = packed_products(params, cfg)
    for name in PRODUCT_WEIGHTS:
        got, stack = packed["layers"][name], params["layers"][name]
        assert got.ndim == (4 if native else 3), name
        if native:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(row_dot.pack(stack)))
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    assert packed[head].ndim == (4 if native else 2)
    if not native:
        return
    np.testing.assert_array_equal(
        np.asarray(packed[head][0]), np.asarray(row_dot.pack(params[head][None])[0])
    )
    ids = np.array([0, 3, 17, cfg.vocab_size - 1], np.int32)
    assert np.array_equal(
        np.asarray(embed_tokens(packed, ids)), np.asarray(embed_tokens(params, ids))
    )
    assert row_invariant_products(packed, cfg)
    layout = KVLayout(
        num_pages=8, page_size=PAGE, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        dtype=dtype,
    )  # fmt: skip
    stacked = layout.stacked(cfg.num_layers)
    step = jax.jit(functools.partial(forward, cfg=cfg, attention=ReferenceAttention(stacked)))
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 20).tolist()
    batch = make_batch(
        [Chunk(prompt, 0, [3, 1, 6])], tokens=32, seqs=2, pages_per_seq=4, page_size=PAGE,
        num_pages=layout.num_pages,
    )  # fmt: skip
    inv_freq = cfg.rope_inv_freq()
    target = row_dot.PACKED_TARGET if dtype == "float32" else row_dot.BF16_PACKED_TARGET
    assert target in step.lower(packed, stacked.empty(), batch, inv_freq).as_text()
    x_lanes, _ = step(params, stacked.empty(), batch, inv_freq)
    x_packed, _ = step(packed, stacked.empty(), batch, inv_freq)
    lanes, ours = (np.asarray(x[: len(prompt)], np.float32) for x in (x_lanes, x_packed))
    tol = 1e-4 if dtype == "float32" else 0.05  # another summation order's rounding
    np.testing.assert_allclose(ours, lanes, rtol=tol, atol=tol)
    logits = [np.asarray(head_logits(p, x_lanes[:4], cfg)) for p in (params, packed)]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    consumed = {**params, "layers": dict(params["layers"])}
    packed_products(consumed, cfg, consume=True)
    assert not set(PRODUCT_WEIGHTS) & set(consumed["layers"]) and head not in consumed
