"""A step's layer products on XLA:CPU: XLA's own product against engine.row_dot's kernel.

Run: `python -m bench.cpu_products [--model smollm2-135m] [--rows 1,2,8,32,256]
[--repeats 5] [--json OUT]` prints one line per (form, rows) and, with --json, writes them.

Every layer's q/k/v, output, gate/up and down products of a model shape (random float32
weights, one array per layer; also stacked and packed, as the engine serves them in
float32, and in bfloat16 where the processor has its dot products) in one jitted
program, `rows` rows each: the median seconds of `repeats` calls, the weights' bytes over
that time, and whether row 0's bits are those it has alone (the property the engine needs
for a sequence to get the same tokens alone and in a batch). The head is left out: it is
one more product of the same kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


# (layers, hidden, heads, kv heads, head_dim, intermediate): SmolLM2-135M's config.json
SMOLLM2 = (30, 576, 9, 3, 64, 1536)


def layer_shapes(name: str) -> tuple[int, list[tuple[int, int]]]:
    """(layers, [(out, in), ...]) as the engine fuses them: SmolLM2-135M, or a
    bench.model_shapes config ("1b", "8b")."""
    if name == "smollm2-135m":
        layers, h, heads, kv_heads, dim, i = SMOLLM2
    else:
        from bench.model_shapes import CONFIGS

        c = CONFIGS[name]
        layers, h, heads, kv_heads = c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads
        dim, i = c.head_dim, c.intermediate_size
    q, kv = heads * dim, kv_heads * dim
    return layers, [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def measure(
    model: str, rows: list[int], repeats: int, dtype: str = "float32"
) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from engine import row_dot
    from engine.model import project

    if not row_dot.serves(dtype):
        raise SystemExit(f"engine.row_dot's kernel does not serve {dtype} here")
    layers, shapes = layer_shapes(model)
    rng = np.random.default_rng(0)
    weights = [
        [jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in shapes]
        for _ in range(layers)
    ]
    weight_bytes = sum(w.nbytes for ws in weights for w in ws)
    params = sum(w.size for ws in weights for w in ws)
    widest = max(k for _, k in shapes)
    x_all = jnp.asarray(rng.standard_normal((max(rows), widest), dtype=np.float32), dtype)
    # the layout the engine serves (row_dot.packs), each shape's layers stacked
    # and packed (engine.paged_model.packed_products), read with the layer's index
    stacks = [jnp.stack([ws[i] for ws in weights]) for i in range(len(shapes))]
    forms = ["xla", "kernel"] + (["packed"] if all(map(row_dot.packs, stacks)) else [])
    packed = [row_dot.pack(s) for s in stacks] if "packed" in forms else []
    out: list[dict[str, Any]] = []
    for form in forms:

        def step(ws: list[list[jax.Array]], x: jax.Array, kernel: bool = form == "kernel"):
            return [project(x[:, : w.shape[1]], w, kernel=kernel)[0] for lw in ws for w in lw]

        def packed_step(ws: list[jax.Array], x: jax.Array) -> list[jax.Array]:
            width = [k for _, k in shapes]
            return [
                project(x[:, :k], w, kernel=True, layer=jnp.int32(i))[0]
                for i in range(layers)
                for w, k in zip(ws, width, strict=True)
            ]

        program = jax.jit(packed_step) if form == "packed" else jax.jit(step)
        operands = packed if form == "packed" else weights
        alone = [np.asarray(a) for a in program(operands, x_all[:1])]
        for n in rows:
            x = x_all[:n]
            got = jax.block_until_ready(program(operands, x))
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                jax.block_until_ready(program(operands, x))
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            same = all(np.array_equal(np.asarray(a), b) for a, b in zip(got, alone, strict=True))
            out.append(
                {
                    "form": form,
                    "dtype": dtype,
                    "rows": n,
                    "seconds": round(seconds, 5),
                    "weight_gb_s": round(weight_bytes / seconds / 1e9, 2),
                    "gflop_s": round(2 * n * params / seconds / 1e9, 1),
                    "row0_bits_as_alone": same,
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, 1b or 8b")
    parser.add_argument("--rows", default="1,2,8,32,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    result = measure(args.model, rows, args.repeats, args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
