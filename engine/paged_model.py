"""The decoder over a paged KV cache, one ragged batch a call (the engine core's step).

Owns: `StepBatch` and `forward`, a pure function of (params, pages, batch). A ragged
batch mixes decode rows (a sequence with one query) and prompt chunks (a sequence
with many) in one program: every layer writes the batch's K/V into its pages with
one scatter, then attends through the backend (engine.attention). Shapes come from
the padded token count T and sequence count S only, so one compiled program serves
any mix of the two.

Params are the checkpoint's layout (engine.checkpoint.load_params): the head is
(vocab, hidden), contracted over hidden as it is, and a tied head is the embedding
itself, so no transposed copy is kept. On CPU an untied head is stored hidden-major
instead (`hidden_major_head`, chosen by engine.core.core with the other CPU layouts),
unless engine.row_dot's kernel reads it as stored (ModelConfig.row_products, float32,
and bfloat16 where the processor has its dot products: `row_dot.serves`). There the
layer products and head are stored packed for that kernel instead
(`packed_products`, which the runner applies; a tied embedding is then read from the
packed head).
The layer math is engine.model's. Params quantized by engine.quant (int8 weights with
`<name>_scale` beside them) go through the same functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from engine import row_dot
from engine.attention import Attention, AttentionBatch, Ints
from engine.config import ModelConfig
from engine.mesh import split
from engine.model import Params, attention_inputs, layer_output, rms_norm, rope_tables

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepBatch:
    """One step's tokens, T padded and S padded sequences (see AttentionBatch)."""

    tokens: Ints  # (T,) int32
    positions: Ints  # (T,) int32: each token's position in its sequence
    slots: Ints  # (T,) int32: page * page_size + offset its K/V goes to; padding past all
    attention: AttentionBatch
    last: Ints  # (S,) int32: each sequence's last query (whose logits the step returns)
    lora: Ints | None = None  # (T,) int32: each token's adapter slot (engine.lora), if any


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: its next tokens, from position `start`, and its
    pages (enough for positions < start + len(tokens))."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]


def make_batch(
    chunks: Sequence[Chunk],
    *,
    tokens: int,
    seqs: int,
    pages_per_seq: int,
    page_size: int,
    num_pages: int,
) -> StepBatch:
    """A step's host arrays: these chunks in order, padded to `tokens` tokens and `seqs`
    sequences (padding tokens write nothing and attend to nothing)."""
    count = sum(len(c.tokens) for c in chunks)
    if count > tokens or len(chunks) > seqs:
        raise ValueError(f"{count} tokens in {len(chunks)} sequences exceed {tokens} / {seqs}")
    ids = np.zeros(tokens, np.int32)
    positions = np.zeros(tokens, np.int32)
    slots = np.full(tokens, num_pages * page_size, np.int32)
    kv_lens = np.zeros(seqs, np.int32)
    page_indices = np.zeros((seqs, pages_per_seq), np.int32)
    cu = np.zeros(seqs + 1, np.int32)
    last = np.zeros(seqs, np.int32)
    at = 0
    for s, chunk in enumerate(chunks):
        n, end = len(chunk.tokens), chunk.start + len(chunk.tokens)
        if -(-end // page_size) > len(chunk.pages) or len(chunk.pages) > pages_per_seq:
            raise ValueError(f"sequence {s}: {len(chunk.pages)} pages for {end} positions")
        pos = np.arange(chunk.start, end, dtype=np.int32)
        table = np.asarray(chunk.pages, np.int32)
        ids[at : at + n] = chunk.tokens
        positions[at : at + n] = pos
        slots[at : at + n] = table[pos // page_size] * page_size + pos % page_size
        kv_lens[s] = end
        page_indices[s, : len(table)] = table
        at += n
        cu[s + 1] = at
        last[s] = at - 1
    cu[len(chunks) + 1 :] = at
    attention = AttentionBatch(kv_lens, page_indices, cu, np.array([len(chunks)], np.int32))
    return StepBatch(ids, positions, slots, attention, last)


def head_logits(
    params: Params, x: jax.Array, cfg: ModelConfig, live: jax.Array | None = None
) -> jax.Array:
    """Final norm and vocabulary product of rows (R, hidden) -> float32 (R, vocab).

    The head is (vocab, hidden) (the embedding when tied), contracted over hidden as
    stored: no transposed copy of it exists. An untied head that `hidden_major_head`
    stored as "lm_head_t" (hidden, vocab) goes through `_hidden_major` instead.
    `live` (an int32 scalar): rows from it on are padding; engine.row_dot's product
    leaves their logits at zero at no cost (a step's sequence bucket past its sequences:
    a 128k head at 32 rows is ~20 ms on 2 cores), other products compute them.
    """
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.fixed_order_sums)
    if "lm_head_t" in params:
        return _hidden_major(x, params["lm_head_t"])
    name = "lm_head" if "lm_head" in params else "embed"
    head, scale = params[name], params.get(name + "_scale")
    if scale is None and cfg.row_products and x.dtype == head.dtype and row_dot.serves(head.dtype):
        layer = jnp.int32(0) if head.ndim == 4 else None  # packed: a stack of one
        return row_dot.row_dot(x, head, layer, live)  # a row's bits its own at any row count
    if scale is None:
        return lax.dot_general(x, head, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    # int8 (engine.quant): each vocabulary row's scale applies to its logit
    logits = lax.dot_general(
        x, head.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=F32
    )
    return logits * scale


# Rows per hidden-major product: XLA:CPU gives a row the same bits for any 4..48 rows,
# other bits below 4 and at 64, so the rows go in blocks of 4..32 (padded up to 4).
HEAD_MIN_ROWS, HEAD_MAX_ROWS = 4, 32


def hidden_major_head(params: Params, cfg: ModelConfig) -> Params:
    """Params with an untied, unquantized (vocab, hidden) "lm_head" stored transposed as
    "lm_head_t" (hidden, vocab), no other copy kept; other params unchanged.

    XLA:CPU's product of a few rows with a hidden-major head takes 0.6-0.8x the time of
    the vocab-major one (bench/README); a tied head stays the embedding (a transposed
    copy would cost its bytes again), and other backends keep the checkpoint's layout.
    """
    if "lm_head" not in params or "lm_head_scale" in params:
        return params
    if cfg.row_products and row_dot.serves(params["lm_head"].dtype):  # read as stored
        return params
    out = {k: v for k, v in params.items() if k != "lm_head"}
    head = params["lm_head"]
    sharding = split(head.sharding.mesh, 1) if cfg.head_shards > 1 else head.sharding
    out["lm_head_t"] = jax.jit(jnp.transpose, out_shardings=sharding)(head)
    return out


def _hidden_major(x: jax.Array, head_t: jax.Array) -> jax.Array:
    """x (R, hidden) @ head_t (hidden, vocab) in float32, in row blocks whose sizes give
    every row the same bits whatever R is (HEAD_MIN_ROWS, HEAD_MAX_ROWS)."""
    rows = x.shape[0]

    def product(block: jax.Array) -> jax.Array:
        return jnp.matmul(block, head_t, preferred_element_type=F32)

    if rows <= HEAD_MAX_ROWS:
        padded = max(rows, HEAD_MIN_ROWS)
        return product(jnp.pad(x, ((0, padded - rows), (0, 0))))[:rows]
    blocks = -(-rows // HEAD_MAX_ROWS)
    x = jnp.pad(x, ((0, blocks * HEAD_MAX_ROWS - rows), (0, 0)))
    out = lax.map(product, x.reshape(blocks, HEAD_MAX_ROWS, x.shape[1]))
    return out.reshape(blocks * HEAD_MAX_ROWS, -1)[:rows]


def embed_tokens(params: Params, tokens: Ints) -> jax.Array:
    """The embedding rows of `tokens` in the model's dtype (int8 rows times their scale
    when engine.quant quantized the embedding)."""
    embed = params["embed"]
    x = row_dot.packed_rows(embed, jnp.asarray(tokens)) if embed.ndim == 4 else embed[tokens]
    scale = params.get("embed_scale")
    if scale is None:
        return x
    dtype = params["final_norm"].dtype
    return (x.astype(F32) * scale[tokens][:, None]).astype(dtype)


def stack_layers(params: Params, *, consume: bool = False) -> Params:
    """Params whose "layers" is one dict of arrays with the layer as their leading axis
    (what `forward` scans), each placed as its layers were with that axis whole.

    `consume`: take the arrays out of `params`'s layer dicts (left empty), so each
    weight's layers are released once stacked and at most one weight is held twice
    meanwhile (the runner's params, which nothing else keeps)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    stacked: dict[str, jax.Array] = {}
    for name in list(layers[0]):
        parts = [lp.pop(name) if consume else lp[name] for lp in layers]
        sharding = getattr(parts[0], "sharding", None)  # host arrays: the default device
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        stacked[name] = jax.jit(lambda *a: jnp.stack(a), out_shardings=sharding)(*parts)
        del parts
    return {**params, "layers": stacked}


def forward(
    params: Params,
    pages: jax.Array,
    batch: StepBatch,
    inv_freq: jax.Array,
    cfg: ModelConfig,
    attention: Attention,
) -> tuple[jax.Array, jax.Array]:
    """The batch's tokens through every layer -> (each token's final hidden state (T,
    hidden), pages with the batch's K/V written); `head_logits` of `x[batch.last]` are each
    sequence's next-token logits.

    Params are `stack_layers`'; pages are every layer's (`attention.layout`, stacked
    by KVLayout.stacked): layer l's page p is page l * per_layer + p, so layer l reads
    the batch's page table and slots shifted by that much. The layers run as one
    `lax.scan` (unrolled unless cfg.scan_layers): XLA compiles one layer, not every layer
    inlined, which halves a 30-layer step's compile on a 2-core CPU and makes loading it
    from the compile cache ~7x faster (bench/README, "Start-up")."""
    dtype = params["final_norm"].dtype  # the model's (the embedding may be int8)
    x = embed_tokens(params, batch.tokens)
    cos, sin = rope_tables(jnp.asarray(batch.positions), inv_freq, dtype)
    slots = jnp.asarray(batch.slots)
    lora = None if batch.lora is None else jnp.asarray(batch.lora)
    attention_batch = jax.tree.map(jnp.asarray, batch.attention)  # host arrays too
    table = attention_batch.page_indices
    per_layer = attention.layout.num_pages // cfg.num_layers
    size = attention.layout.page_size
    live = slots < per_layer * size  # padding: past every layer's pages, writing nothing
    # the batch's tokens lie before its padding (make_batch): rows from here on are padding,
    # which the products skip (the same count for every layer)
    live_rows = attention_batch.cu_q_lens[attention_batch.num_seqs[0]]

    stacks = params["layers"]
    whole = in_place_weights(stacks, cfg)

    def layer(
        carry: tuple[jax.Array, jax.Array], lp_l: tuple[Params, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        x, pages = carry
        lp, index = lp_l
        lp = {**lp, **{name: stacks[name] for name in whole}}
        shifted = jnp.where(
            live, slots + index * per_layer * size, cfg.num_layers * per_layer * size
        )
        shifted_batch = dataclasses.replace(attention_batch, page_indices=table + index * per_layer)
        out = _layer(
            lp, pages, x, cos, sin, shifted, shifted_batch, lora, index, live_rows, cfg=cfg,
            attention=attention,
        )  # fmt: skip
        return out, None

    ordinals = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    sliced = {name: w for name, w in stacks.items() if name not in whole}
    (x, pages), _ = lax.scan(layer, (x, pages), (sliced, ordinals), unroll=not cfg.scan_layers)
    return x, pages


def _layer(
    lp: Params,
    pages: jax.Array,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    batch: AttentionBatch,
    lora: jax.Array | None,
    index: jax.Array,
    live_rows: jax.Array,
    *,
    cfg: ModelConfig,
    attention: Attention,
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer (the `index`th): its K/V written into its pages, attention, the
    MLP."""
    q, k, v = attention_inputs(lp, x, cfg, cos, sin, lora, index, live_rows)
    pages = attention.write(pages, k, v, slots)
    attn = attention.attend(q, pages, batch, sliding_window=cfg.sliding_window)
    out = layer_output(lp, x, attn.reshape(x.shape[0], cfg.q_size), cfg, lora, index, live_rows)
    return out, pages


PRODUCT_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def row_invariant_products(params: Params, cfg: ModelConfig) -> bool:
    """Whether every product of a step gives a row the same bits at one row as at many:
    all of them through engine.row_dot (layer weights and head in a dtype it serves here,
    nothing int8, no LoRA pool, whose products are XLA's). Params as `stack_layers` gives them."""
    stacks = params["layers"]
    head = params["lm_head"] if "lm_head" in params else params.get("embed")
    return (
        cfg.row_products
        and head is not None
        and row_dot.serves(head.dtype)
        and "lm_head_t" not in params
        and not any(name.endswith("_scale") for name in (*params, *stacks))
        and not any(name.startswith("lora_") for name in stacks)
        and in_place_weights(stacks, cfg) == tuple(n for n in PRODUCT_WEIGHTS if n in stacks)
    )


def packed_products(params: Params, cfg: ModelConfig, *, consume: bool = False) -> Params:
    """`stack_layers`' params with each stacked product weight, and the head (a stack of
    one: the embedding when tied, which `embed_tokens` then reads packed), that
    engine.row_dot serves packed (`row_dot.packs`: float32, and bfloat16 on the
    processor's dot products) in its packed layout, no copy of it kept; other params as
    they were. Only the kernel reads a packed weight, so nothing is packed without
    ModelConfig.row_products.

    `consume`: take each weight out of `params` and pack it in its own buffer, so no
    weight is held twice (the runner's params, which nothing else keeps)."""
    stacks = params["layers"]
    if not cfg.row_products or not isinstance(stacks, dict):
        return params
    names = [n for n in PRODUCT_WEIGHTS if n in stacks and n + "_scale" not in stacks]
    names = [n for n in names if row_dot.packs(stacks[n])]
    head = "lm_head" if "lm_head" in params else "embed"
    packs_head = head in params and head + "_scale" not in params and "lm_head_t" not in params
    if packs_head:
        one = jax.ShapeDtypeStruct((1, *params[head].shape), params[head].dtype)
        packs_head = row_dot.packs(one)
    if not names and not packs_head:
        return params
    donate = 0 if consume else ()
    pack = jax.jit(row_dot.pack, donate_argnums=donate)
    packed = dict(stacks)
    for name in names:
        packed[name] = pack(stacks.pop(name) if consume else stacks[name])
    out = {**params, "layers": packed}
    if packs_head:
        pack_head = jax.jit(lambda w: row_dot.pack(w[None]), donate_argnums=donate)
        out[head] = pack_head(params.pop(head) if consume else params[head])
    return out


def in_place_weights(stacks: Params, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked layer weights the layers read in place, not as the scan's slices:
    products through engine.row_dot (ModelConfig.row_products, `row_dot.serves`), which reads a
    layer out of the stack where XLA would copy each slice out first (a pass over the
    weights every step)."""
    if not cfg.row_products:
        return ()
    return tuple(
        name
        for name in PRODUCT_WEIGHTS
        if name in stacks and row_dot.serves(stacks[name].dtype) and name + "_scale" not in stacks
    )
